"""``POST /v1/messages`` driven by Anthropic's own SDK: whole, streamed, with ``cache_control``, its usage fields,
its error shape, and the key sent as ``x-api-key``."""

import httpx
import pytest

from tests.server.harness import API_KEY

anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is a dev extra")

SYSTEM = "You are a helpful assistant. Answer briefly and truthfully."
GREEDY = {"temperature": 0}  # today's SDK no longer has the sampling arguments; the API still takes them


@pytest.fixture
def claude(server) -> "anthropic.Anthropic":
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def test_a_whole_message(server, claude, model_name):
    reply = claude.messages.create(
        model=model_name,
        max_tokens=4,
        extra_body=GREEDY,
        system=SYSTEM,
        messages=[{"role": "user", "content": "The quick brown fox"}],
    )
    assert reply.type == "message" and reply.role == "assistant" and reply.model == model_name
    assert [block.type for block in reply.content] == ["text"]
    assert reply.stop_reason in ("max_tokens", "end_turn")
    assert 1 <= reply.usage.output_tokens <= 4
    prompt = httpx.post(
        f"{server.url}/v1/messages/count_tokens",
        json={"model": model_name, "system": SYSTEM, "messages": [{"role": "user", "content": "The quick brown fox"}]},
    ).json()["input_tokens"]
    # no breakpoint writes nothing retained; it may read what other requests retained of this system prompt
    assert reply.usage.cache_creation_input_tokens == 0
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == prompt
    assert (
        claude.messages.count_tokens(
            model=model_name, system=SYSTEM, messages=[{"role": "user", "content": "The quick brown fox"}]
        ).input_tokens
        == prompt
    )


def test_the_stream_is_anthropics_events_and_says_what_the_whole_message_says(server, claude, model_name):
    question = {
        "model": model_name,
        "max_tokens": 5,
        "extra_body": GREEDY,
        "messages": [{"role": "user", "content": "hi"}],
    }
    whole = claude.messages.create(**question)
    with claude.messages.stream(**question) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    body = {**{k: v for k, v in question.items() if k != "extra_body"}, **GREEDY, "stream": True}
    raw = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60).text
    assert 'event: ping\ndata: {"type":"ping"}' in raw


def test_stop_sequences_stop_and_are_named(claude, model_name):
    question = {
        "model": model_name,
        "max_tokens": 12,
        "extra_body": GREEDY,
        "messages": [{"role": "user", "content": "hi"}],
    }
    free = claude.messages.create(**question).content[0].text
    assert len(free) >= 3, f"the tiny model's greedy reply {free!r} is too short to stop inside"
    stop = free[1:3]
    stopped = claude.messages.create(**question, stop_sequences=[stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == free[: free.index(stop)]


def test_cache_control_writes_then_reads_retained_tokens(server, claude, model_name):
    """Anthropic's accounting: the first call writes its marked prefix (a block it hit that it marked counts as
    read), the second reads all of it, and input + written + read is the whole prompt. What is retained is the
    whole blocks (4 tokens here) before the breakpoint: the end of the system block."""
    system = "Prefix caching reuses the keys and values of shared prompt prefixes."
    question = {
        "model": model_name,
        "max_tokens": 2,
        "extra_body": GREEDY,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    }
    prompt = claude.messages.count_tokens(**{k: v for k, v in question.items() if k in ("model", "system", "messages")})
    first = claude.messages.create(**question).usage
    second = claude.messages.create(**question).usage
    marked = len(httpx.post(f"{server.url}/tokenize", json={"prompt": f"<|system|>{system}"}).json()["tokens"])
    assert first.cache_creation_input_tokens > 0
    assert first.cache_creation_input_tokens + first.cache_read_input_tokens == marked // 4 * 4
    assert second.cache_read_input_tokens == marked // 4 * 4 and second.cache_creation_input_tokens == 0
    # Anthropic's split of what was written by TTL: all of it 1h
    split = first.cache_creation
    assert (split.ephemeral_1h_input_tokens, split.ephemeral_5m_input_tokens) == (first.cache_creation_input_tokens, 0)
    assert (second.cache_creation.ephemeral_1h_input_tokens, second.cache_creation.ephemeral_5m_input_tokens) == (0, 0)
    for usage in (first, second):
        total = usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens
        assert total == prompt.input_tokens
    with claude.messages.stream(**question) as stream:
        streamed = stream.get_final_message().usage
    assert (streamed.cache_read_input_tokens, streamed.cache_creation_input_tokens) == (marked // 4 * 4, 0)


def test_top_level_cache_control_marks_the_end_of_the_last_block(server, claude, model_name):
    text = "0123456789 abcdefghijklmnopqrstuvwxyz (top level)"
    question = {
        "model": model_name,
        "max_tokens": 2,
        "extra_body": GREEDY,
        "messages": [{"role": "user", "content": text}],
    }
    first = claude.messages.create(**question, cache_control={"type": "ephemeral"}).usage
    second = claude.messages.create(**question, cache_control={"type": "ephemeral"}).usage
    marked = len(httpx.post(f"{server.url}/tokenize", json={"prompt": f"<|user|>{text}"}).json()["tokens"])
    assert first.cache_creation_input_tokens > 0
    assert first.cache_creation_input_tokens + first.cache_read_input_tokens == marked // 4 * 4
    assert (second.cache_read_input_tokens, second.cache_creation_input_tokens) == (marked // 4 * 4, 0)
    split = first.cache_creation  # the default TTL: all of it 5m
    assert (split.ephemeral_5m_input_tokens, split.ephemeral_1h_input_tokens) == (first.cache_creation_input_tokens, 0)


def test_tools_with_cache_control_reach_the_template(claude, model_name):
    tools = [
        {
            "name": "lookup",
            "description": "Find a word",
            "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}},
            "cache_control": {"type": "ephemeral"},
        }
    ]
    messages = [{"role": "user", "content": "hi"}]
    with_tools = claude.messages.count_tokens(model=model_name, messages=messages, tools=tools).input_tokens
    without = claude.messages.count_tokens(model=model_name, messages=messages).input_tokens
    assert with_tools > without
    reply = claude.messages.create(model=model_name, max_tokens=2, messages=messages, tools=tools)
    assert reply.usage.input_tokens + reply.usage.cache_creation_input_tokens + reply.usage.cache_read_input_tokens == (
        with_tools
    )


def _five_breakpoints() -> list[dict]:
    marked = {"type": "ephemeral"}
    return [
        {"role": "user", "content": [{"type": "text", "text": f"turn {i}", "cache_control": marked}]} for i in range(5)
    ]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"messages": _five_breakpoints()}, "cache_control"),
        ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]}, "ttl"),
        ({"messages": [{"role": "assistant", "content": "prefill"}]}, "last message"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking"),
        ({"temperature": -1}, "temperature"),
    ],
    ids=["5th-breakpoint", "ttl", "prefill", "unsupported", "temperature"],
)
def test_errors_are_anthropics_shape_and_name_the_field(claude, model_name, fields, named):
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=model_name, max_tokens=2, messages=hi, extra_body=fields)
    error = refused.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]


def test_max_tokens_is_required_and_an_unknown_model_is_not_found(server, claude, model_name):
    response = httpx.post(
        f"{server.url}/v1/messages", json={"model": model_name, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in response.text
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="nope", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"


def test_the_api_key_may_come_as_x_api_key(secured_server):
    question = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    good = anthropic.Anthropic(base_url=secured_server.url, api_key=API_KEY, max_retries=0, timeout=60)
    assert good.messages.create(**question).usage.output_tokens >= 1
    bad = anthropic.Anthropic(base_url=secured_server.url, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        bad.messages.create(**question)
    assert refused.value.body["error"]["type"] == "authentication_error"
    assert httpx.get(f"{secured_server.url}/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
