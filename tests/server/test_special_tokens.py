"""Special tokens as vLLM adds them, on a real server of a tiny model whose tokenizer adds a BOS (as Llama's,
Gemma's and Mistral's do): a completion's text gets it unless ``add_special_tokens: false``, a chat none beyond
its template; and ``prefixcache router``, ``/v1/cache/lookup`` and ``explain`` hash exactly what the engine runs."""

import json

import httpx
import pytest

from prefixcache.cli import main
from prefixcache.model.loader import load_tokenizer
from prefixcache.router.backend_config import parse_cache_config
from prefixcache.router.prompt import CHAT, COMPLETION, PromptHasher
from tests.helpers import CORPUS, wait_until
from tests.router.fakes import metric
from tests.router.test_serve_backends import kv_events_args, start_router
from tests.server.harness import SERVER_ARGS, ServerProcess

TEXT = " ".join(CORPUS[1:3])
MESSAGES = [{"role": "user", "content": CORPUS[0]}]
# The second test's own prompts, which the first one never sent (explain replays from an empty cache).
DOCUMENT = CORPUS[3] + " " + CORPUS[2]
FOLLOW_UP = DOCUMENT + " " + CORPUS[1]
QUESTION = [{"role": "system", "content": CORPUS[3]}, {"role": "user", "content": "Why?"}]


@pytest.fixture(scope="module")
def bos_server(tiny_bos_dir, tmp_path_factory):
    server = ServerProcess(tiny_bos_dir, [*SERVER_ARGS, *kv_events_args()], tmp_path_factory.mktemp("bos") / "log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_bos_dir):
    return load_tokenizer(tiny_bos_dir)


def shape_of(body: dict) -> str:
    return CHAT if "messages" in body else COMPLETION


def post(server, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_completions_text_gets_the_bos_and_a_chat_only_its_templates(bos_server, tokenizer):
    bos = tokenizer.bos_token_id
    bare = tokenizer.encode(TEXT, add_special_tokens=False)
    assert post(bos_server, "/tokenize", {"prompt": TEXT})["tokens"] == [bos, *bare]
    assert post(bos_server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False})["tokens"] == bare
    chat = post(bos_server, "/tokenize", {"messages": MESSAGES})["tokens"]
    assert chat[0] == bos and chat.count(bos) == 1  # the template's own BOS, none added on top
    assert post(bos_server, "/tokenize", {"messages": MESSAGES, "add_special_tokens": True})["tokens"] == [bos, *chat]

    body = {"prompt": TEXT, "max_tokens": 1}
    assert post(bos_server, "/v1/completions", body)["usage"]["prompt_tokens"] == len(bare) + 1
    unmarked = {**body, "add_special_tokens": False}
    assert post(bos_server, "/v1/completions", unmarked)["usage"]["prompt_tokens"] == len(bare)
    assert [r["token_ids"] for r in post(bos_server, "/v1/completions/render", body)] == [[bos, *bare]]
    assert post(bos_server, "/v1/completions/render", unmarked)[0]["token_ids"] == bare
    assert post(bos_server, "/v1/chat/completions/render", {"messages": MESSAGES})["token_ids"] == chat
    assert post(bos_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})["usage"][
        "prompt_tokens"
    ] == len(chat)
    assert post(bos_server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1})["usage"]["prompt_tokens"] == 3
    assert httpx.get(f"{bos_server.url}/tokenizer_info").json()["add_special_tokens"] is True


def test_the_router_the_lookup_and_explain_hash_what_the_engine_runs(bos_server, tokenizer, tiny_bos_dir, tmp_path):
    config = parse_cache_config(httpx.get(f"{bos_server.url}/v1/cache/config").content)
    hasher = PromptHasher.for_engine(tokenizer, config)
    bodies = [
        {"prompt": DOCUMENT, "max_tokens": 1},
        {"prompt": FOLLOW_UP, "max_tokens": 1},
        {"messages": QUESTION, "max_tokens": 1},
        {"messages": [*QUESTION, {"role": "assistant", "content": "ok"}], "max_tokens": 1},
        {"prompt": FOLLOW_UP, "max_tokens": 1, "add_special_tokens": False},
    ]
    router = start_router([bos_server], "prefix", tokenizer)
    try:
        index = router.app.state.index
        reported, looked_up, stored = [], [], set()
        for body in bodies:
            lookup = post(bos_server, "/v1/cache/lookup", {**body, "return_token_ids": True})
            token_ids = lookup["prompt_token_ids"]
            assert token_ids == hasher.token_ids(body, shape_of(body))
            looked_up.append(lookup["cached_tokens"])
            response = httpx.post(
                f"{router.url}/v1/{'chat/' if 'messages' in body else ''}completions", json=body, timeout=60
            )
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            assert usage["prompt_tokens"] == len(lookup["prompt_token_ids"])
            reported.append(usage["prompt_tokens_details"]["cached_tokens"])
            stored.update(hasher.key([*token_ids, 0]).block_hashes)  # every full block of the prompt
            wait_until(lambda: index.num_blocks(bos_server.url) >= len(stored), what="the blocks in the index")
        assert reported[1] > 0 and reported[3] > 0  # the follow-ups hit: the BOS was hashed alike
        assert looked_up == reported
        assert metric(router, "predicted_cached_tokens_total") == metric(router, "reported_cached_tokens_total")
        assert metric(router, "reported_cached_tokens_total") == sum(reported)
    finally:
        router.stop()

    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(body) + "\n" for body in bodies))
    for source in (["--model", str(tiny_bos_dir)], ["--base-url", bos_server.url]):
        out = tmp_path / "report.json"
        main(["explain", str(log), *source, "--block-size", str(config.block_size), "--json", str(out)])
        requests = json.loads(out.read_text())["requests"]
        assert [r["prompt_tokens"] for r in requests] == [len(hasher.token_ids(b, shape_of(b))) for b in bodies]
        assert [r["block_hit"] for r in requests] == reported
