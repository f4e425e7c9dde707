"""The router in front of real ``prefixcache serve`` processes on the tiny model (loopback, port 0)."""

import json
import socket

import httpx
import pytest

from prefixcache.core.hashing import resolve_hash_seed
from prefixcache.core.tenant_salt import SALT_BY_API_KEY
from prefixcache.model.loader import load_tokenizer
from prefixcache.router.app import RouterSettings, build_app
from prefixcache.router.backend_config import parse_cache_config
from prefixcache.router.backends import HealthSettings
from prefixcache.router.prompt import CHAT, COMPLETION, MESSAGES, PromptHasher
from prefixcache.router.proxy import BACKEND_HEADER
from tests.helpers import wait_until
from tests.router.fakes import HANG_S, ThreadedServer, metric
from tests.server.harness import API_KEY, OTHER_API_KEY, ServerProcess, random_prompt

SERVE_ARGS = ["--block-size", "4", "--num-blocks", "256", "--max-model-len", "256", "--disable-uvicorn-access-log"]
CONVERSATION = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi there"}]


def start_servers(model_dir, logs, extra_args=()) -> list[ServerProcess]:
    servers = [
        ServerProcess(model_dir, [*SERVE_ARGS, *args], logs / f"serve-{i}.log") for i, args in enumerate(extra_args)
    ]
    try:
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def start_router(servers, policy, tokenizer, backend_api_key=None) -> ThreadedServer:
    settings = RouterSettings(
        backends=tuple(s.url for s in servers),
        policy=policy,
        health=HealthSettings(interval=3600.0, timeout=HANG_S, replay_timeout=HANG_S),
        backend_api_key=backend_api_key,
    )
    return ThreadedServer(build_app(settings, tokenizer))


@pytest.fixture(scope="module")
def servers(tiny_llama_dir, tmp_path_factory):
    started = start_servers(tiny_llama_dir, tmp_path_factory.mktemp("router-serve"), [[], []])
    yield started
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(tiny_llama_dir)


def test_the_server_tells_how_it_keys_its_cache(servers, tiny_llama_dir):
    response = httpx.get(f"{servers[0].url}/v1/cache/config")
    assert response.status_code == 200
    assert response.json() == {
        "model": tiny_llama_dir.name,
        "max_model_len": 256,
        "block_size": 4,
        "num_blocks": 256,
        "hash_algo": "sha256",
        "hash_seed": resolve_hash_seed(),  # the default, or $PREFIXCACHE_HASH_SEED as the servers inherit it
        "enable_prefix_caching": True,
        "tenant_salt": None,
        "kv_cache_groups": [{"group_idx": 0, "kind": "full_attention", "block_size": 4, "sliding_window": None}],
        "recurrent_state": None,
        "kv_events": None,
    }
    parse_cache_config(response.content)  # the router reads it


def test_the_router_tokenizes_like_the_server(servers, tokenizer, tiny_llama_dir):
    config = parse_cache_config(httpx.get(f"{servers[0].url}/v1/cache/config").content)
    hasher = PromptHasher.for_engine(tokenizer, config)
    text = "The quick brown fox jumps over the lazy dog."
    system = [
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "!"},
    ]
    tool = {"name": "lookup", "description": "Find a word", "input_schema": {"type": "object"}}
    anthropic = {"model": tiny_llama_dir.name, "system": system, "tools": [tool], "messages": CONVERSATION[1:]}
    for path, body, shape in (
        ("/v1/chat/completions", {"messages": CONVERSATION, "max_tokens": 1}, CHAT),
        ("/v1/completions", {"prompt": text, "max_tokens": 1}, COMPLETION),
        ("/v1/messages", {**anthropic, "max_tokens": 1}, MESSAGES),
    ):
        usage = httpx.post(f"{servers[0].url}{path}", json=body, timeout=60).json()["usage"]
        prompt_tokens = usage.get("prompt_tokens") or sum(
            usage[f] for f in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
        )
        assert len(hasher.token_ids(body, shape)) == prompt_tokens


def test_requests_pass_through_streamed_and_whole(servers, tokenizer):
    router = start_router(servers, "round_robin", tokenizer)
    try:
        chat = httpx.post(
            f"{router.url}/v1/chat/completions", json={"messages": CONVERSATION, "max_tokens": 3}, timeout=60
        )
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
        body = {"prompt": random_prompt("stream", 12), "max_tokens": 4, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
            backend = response.headers[BACKEND_HEADER]
        assert lines[-1] == "data: [DONE]" and len(lines) == 5
        assert backend != chat.headers[BACKEND_HEADER]  # round robin used both
        models = httpx.get(f"{router.url}/v1/models").json()
        assert models["data"][0]["max_model_len"] == 256
        assert httpx.get(f"{router.url}/health").status_code == 200
    finally:
        router.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_events_args() -> list[str]:
    """KV events on, published on free loopback ports (a wildcard bind, as in production)."""
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{_free_port()}",
        "replay_endpoint": f"tcp://*:{_free_port()}",
    }
    return ["--kv-events-config", json.dumps(events)]


def test_prefix_routing_on_real_kv_events(tiny_llama_dir, tmp_path, tokenizer):
    started = start_servers(tiny_llama_dir, tmp_path, [kv_events_args() for _ in range(2)])
    router = start_router(started, "prefix", tokenizer)
    try:
        index = router.app.state.index
        prompt = random_prompt("tenant", 40)
        first = httpx.post(f"{router.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
        holder = first.headers[BACKEND_HEADER]
        wait_until(lambda: index.num_blocks(holder) >= 9, what="the first request's blocks in the index")
        for _ in range(3):
            again = httpx.post(
                f"{router.url}/v1/completions", json={"prompt": prompt + [5], "max_tokens": 1}, timeout=60
            )
            assert again.headers[BACKEND_HEADER] == holder
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
        text = httpx.get(f"{router.url}/metrics").text
        assert 'prefixcache:router_predicted_cached_tokens_total{backend="' + holder + '"} 120.0' in text
        assert 'prefixcache:router_reported_cached_tokens_total{backend="' + holder + '"} 120.0' in text
    finally:
        router.stop()
        for server in started:
            server.stop()


def test_prefix_routing_over_keyed_backends_hashes_each_tenant_like_they_do(tiny_llama_dir, tmp_path, tokenizer):
    router_key = "router-key"
    keys = ["--api-key", router_key, "--api-key", API_KEY, "--api-key", OTHER_API_KEY]
    started = start_servers(tiny_llama_dir, tmp_path, [[*keys, *kv_events_args()] for _ in range(2)])
    router = start_router(started, "prefix", tokenizer, backend_api_key=router_key)

    def complete(key: str | None, prompt: list[int]) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        body = {"prompt": prompt, "max_tokens": 1}
        return httpx.post(f"{router.url}/v1/completions", json=body, headers=headers, timeout=60)

    def served(key: str, prompt: list[int]) -> tuple[str, int]:
        response = complete(key, prompt)
        assert response.status_code == 200, response.text
        return response.headers[BACKEND_HEADER], response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    try:
        pool, index = router.app.state.pool, router.app.state.index
        assert len(pool.routable()) == 2 and pool.reference.tenant_salt == SALT_BY_API_KEY
        assert complete(None, [1, 2, 3]).status_code == 401  # the client's missing key, not the router's
        prompt = random_prompt("keyed", 40)
        holder, cached = served(API_KEY, prompt)
        assert cached == 0
        wait_until(lambda: index.num_blocks(holder) == 10, what="the first request's blocks in the index")
        # the other tenant's same prompt: no hit predicted, and none reported by whichever backend took it
        assert served(OTHER_API_KEY, prompt + [5])[1] == 0
        assert metric(router, "predicted_cached_tokens_total") == 0
        for _ in range(3):
            assert served(API_KEY, prompt + [5]) == (holder, 40)
        assert metric(router, "predicted_cached_tokens_total") == 120
        assert metric(router, "reported_cached_tokens_total") == 120
    finally:
        router.stop()
        for server in started:
            server.stop()


def test_a_deeply_nested_body_gets_the_servers_400_through_the_router(servers, tokenizer):
    """It made the router's JSON parser raise RecursionError: a text/plain 500 from the router."""
    router = start_router(servers, "prefix", tokenizer)
    try:
        nested = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        headers = {"content-type": "application/json"}
        direct = httpx.post(f"{servers[0].url}/v1/completions", content=nested, headers=headers, timeout=60)
        routed = httpx.post(f"{router.url}/v1/completions", content=nested, headers=headers, timeout=60)
        assert direct.status_code == routed.status_code == 400
        assert routed.json()["error"] == direct.json()["error"]
        assert httpx.post(f"{router.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 1}).status_code == 200
    finally:
        router.stop()
