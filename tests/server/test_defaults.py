"""Defaults that never trip a first run, on a server whose KV cache holds less than the context (a small
``--kv-cache-memory`` on a long-context model): a request that leaves its limits unset gets what fits."""

import httpx
import pytest

from tests.server.harness import ServerProcess, random_prompt

BLOCK_SIZE, NUM_BLOCKS, CONTEXT = 4, 40, 256
KV_CAPACITY = BLOCK_SIZE * NUM_BLOCKS  # 160 tokens: one full-attention group, no null block
MESSAGES = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]


@pytest.fixture(scope="module")
def small_cache_server(tiny_llama_dir, tmp_path_factory):
    args = ["--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS), "--max-model-len", str(CONTEXT)]
    server = ServerProcess(tiny_llama_dir, args, tmp_path_factory.mktemp("small-cache") / "serve.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def test_a_chat_without_max_tokens_may_grow_to_what_the_kv_cache_holds(small_cache_server):
    rendered = post(small_cache_server, "/v1/chat/completions/render", {"messages": MESSAGES})
    assert rendered.status_code == 200, rendered.text  # vllm-router renders before every request
    prompt_tokens = len(rendered.json()["token_ids"])
    assert rendered.json()["sampling_params"]["max_tokens"] == KV_CAPACITY - prompt_tokens
    body = {"messages": MESSAGES, "temperature": 0, "ignore_eos": True}
    answer = post(small_cache_server, "/v1/chat/completions", body)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == KV_CAPACITY
    assert answer.json()["choices"][0]["finish_reason"] == "length"


def test_truncating_to_what_fits_keeps_what_the_kv_cache_holds(small_cache_server):
    prompt = random_prompt("truncate-to-cache", 200)  # fits the context, not the KV cache
    body = {"prompt": prompt, "max_tokens": 4, "truncate_prompt_tokens": -1, "temperature": 0}
    answer = post(small_cache_server, "/v1/completions", body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == KV_CAPACITY - 4
    too_long = post(small_cache_server, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
    assert too_long.status_code == 400
    assert "cannot fit the KV cache of 160 tokens" in too_long.json()["error"]["message"]


def test_echo_with_zero_max_tokens_scores_a_prompt_of_the_whole_context(server):
    prompt = random_prompt("whole-context", 256)  # the session server's context
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    answer = post(server, "/v1/completions", body)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]] == prompt
    assert answer.json()["usage"]["completion_tokens"] == 0
    one_more = post(server, "/v1/completions", {**body, "prompt": [*prompt, 5]})
    assert one_more.status_code == 400 and "context length" in one_more.json()["error"]["message"]
    generating = post(server, "/v1/completions", {**body, "max_tokens": 1})
    assert generating.status_code == 400 and "context length" in generating.json()["error"]["message"]
