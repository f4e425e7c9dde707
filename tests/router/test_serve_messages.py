"""Anthropic's Messages API through the router, driven by Anthropic's own SDK: two keyed ``prefixcache serve``
backends on the tiny model behind a prefix-routing router. The SDK sends its key as ``x-api-key``; the router
salts the prompt by it as the backends do, routes the second request to the backend that holds its marked
system prompt, and predicts exactly the ``cache_read_input_tokens`` the backend reports, whole and streamed."""

import httpx
import pytest

from prefixcache.model.loader import load_tokenizer
from prefixcache.router.proxy import BACKEND_HEADER
from tests.helpers import wait_until
from tests.router.fakes import metric
from tests.router.test_serve_backends import kv_events_args, start_router, start_servers
from tests.server.harness import API_KEY

anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is a dev extra")

ROUTER_KEY = "router-key"
BLOCK_SIZE = 4  # test_serve_backends.SERVE_ARGS
SYSTEM = "Prefix caching reuses the keys and values of shared prompt prefixes across requests."
GREEDY = {"temperature": 0}  # today's SDK no longer has the sampling arguments; the API still takes them


@pytest.fixture(scope="module")
def routed(tiny_llama_dir, tmp_path_factory):
    keys = ["--api-key", ROUTER_KEY, "--api-key", API_KEY]
    logs = tmp_path_factory.mktemp("router-messages")
    servers = start_servers(tiny_llama_dir, logs, [[*keys, *kv_events_args()] for _ in range(2)])
    router = start_router(servers, "prefix", load_tokenizer(tiny_llama_dir), backend_api_key=ROUTER_KEY)
    try:
        yield router, servers
    finally:
        router.stop()
        for server in servers:
            server.stop()


def question(model: str, user: str, max_tokens: int = 3) -> dict:
    """The SDK's arguments: a system prompt marked ``cache_control`` (1h), then ``user``."""
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    return {
        "model": model,
        "max_tokens": max_tokens,
        "extra_body": GREEDY,
        "system": system,
        "messages": [{"role": "user", "content": user}],
    }


def conversation(arguments: dict) -> dict:
    """What ``count_tokens`` takes of a question."""
    return {k: v for k, v in arguments.items() if k in ("model", "system", "messages")}


def prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens


def test_messages_are_routed_by_their_prefix_and_the_predicted_read_is_the_reported_one(routed, tiny_llama_dir):
    router, servers = routed
    model = tiny_llama_dir.name
    claude = anthropic.Anthropic(base_url=router.url, api_key=API_KEY, max_retries=0, timeout=60)
    index = router.app.state.index
    tokenized = httpx.post(
        f"{servers[0].url}/tokenize", json={"prompt": f"<|system|>{SYSTEM}"}, headers={"x-api-key": API_KEY}
    )
    marked = len(tokenized.json()["tokens"])
    retained = marked // BLOCK_SIZE * BLOCK_SIZE  # the whole blocks before the breakpoint

    raw = claude.messages.with_raw_response.create(**question(model, "hi"))
    first, holder = raw.parse(), raw.headers[BACKEND_HEADER]
    assert first.type == "message" and first.content[0].type == "text"
    assert (first.usage.cache_creation_input_tokens, first.usage.cache_read_input_tokens) == (retained, 0)
    assert first.usage.cache_creation.ephemeral_1h_input_tokens == retained  # Anthropic's split by TTL, passed on
    # its blocks (and their retention, which their events carry) in the router's index
    first_blocks = prompt_tokens(first.usage) // BLOCK_SIZE
    wait_until(lambda: index.num_blocks(holder) >= first_blocks, what="the first request's blocks in the index")

    raw = claude.messages.with_raw_response.create(**question(model, "hello there"))
    second = raw.parse()
    assert raw.headers[BACKEND_HEADER] == holder
    assert (second.usage.cache_read_input_tokens, second.usage.cache_creation_input_tokens) == (retained, 0)
    assert (
        prompt_tokens(second.usage)
        == claude.messages.count_tokens(**conversation(question(model, "hello there"))).input_tokens
    )

    with claude.messages.stream(**question(model, "hello again")) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
        assert stream.response.headers[BACKEND_HEADER] == holder
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert (streamed.usage.cache_read_input_tokens, streamed.usage.cache_creation_input_tokens) == (retained, 0)
    assert 1 <= streamed.usage.output_tokens <= 3

    # the router's prediction of what was read from retained blocks, request by request: 0, then all of it twice
    assert metric(router, "predicted_cached_tokens_total") == 2 * retained
    assert metric(router, "reported_cached_tokens_total") == 2 * retained


def test_errors_on_messages_are_anthropics_from_the_backend_and_from_the_router(routed, tiny_llama_dir):
    router, _ = routed
    claude = anthropic.Anthropic(base_url=router.url, api_key=API_KEY, max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as refused:  # the backend's 400: max_tokens below 1
        claude.messages.create(**{**question(tiny_llama_dir.name, "hi"), "max_tokens": 0})
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in refused.value.body["error"]["message"]
    # past the backends' 256-token context
    too_long = {**conversation(question(tiny_llama_dir.name, "many words " * 300)), "max_tokens": 1}
    response = httpx.post(f"{router.url}/v1/messages", json=too_long, headers={"x-api-key": API_KEY}, timeout=60)
    assert response.status_code == 400 and BACKEND_HEADER not in response.headers  # the router's own refusal
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    assert "context length" in response.json()["error"]["message"]
