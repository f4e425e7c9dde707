"""Bad input gets a 4xx in OpenAI's error shape and the server keeps serving; hostile values hurt no other
request; unsupported parameters are refused by name; request ids; auth and the reset switch."""

import asyncio
import logging
import time

import httpx
import openai
import pytest

from prefixcache.http.middleware import RequestContextMiddleware
from tests.helpers import wait_until
from tests.server.harness import API_KEY, random_prompt, start_streams

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]

BAD_REQUESTS = [
    pytest.param(COMPLETIONS, b'{"prompt": "hi", ', 400, None, id="malformed-json"),
    pytest.param(COMPLETIONS, b"", 400, None, id="no-body"),
    pytest.param(COMPLETIONS, {"max_tokens": 2}, 400, "prompt", id="missing-prompt"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", id="wrong-type"),
    pytest.param(COMPLETIONS, {"prompt": {"text": "hi"}}, 400, "prompt", id="prompt-not-text-or-ids"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "model": "no-such-model"}, 404, "model", id="unknown-model"),
    pytest.param(COMPLETIONS, {"prompt": ""}, 400, None, id="empty-prompt"),
    pytest.param(COMPLETIONS, {"prompt": []}, 400, None, id="empty-token-ids"),
    pytest.param(COMPLETIONS, {"prompt": random_prompt("long", 300)}, 400, None, id="prompt-beyond-context"),
    pytest.param(COMPLETIONS, {"prompt": [5, 512]}, 400, None, id="token-id-beyond-vocab"),
    pytest.param(COMPLETIONS, {"prompt": [5, -1]}, 400, None, id="negative-token-id"),
    pytest.param(COMPLETIONS, {"prompt": [5, 512], "stream": True}, 400, None, id="streaming-bad-ids"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, None, id="zero-max-tokens"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "max_tokens": 1000}, 400, None, id="max-tokens-beyond-context"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "temperature": -0.5}, 400, None, id="negative-temperature"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "cache_salt": ""}, 400, "cache_salt", id="empty-salt"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "cache_salt": "s" * 129}, 400, "cache_salt", id="long-salt"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "cache_salt": "a\nb"}, 400, "cache_salt", id="unprintable-salt"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "n": 0}, 400, "n", id="n-zero"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "n": 129}, 400, "n", id="n-above-128"),
    pytest.param(COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 50}, 400, None, id="too-many-choices"),
    pytest.param(
        COMPLETIONS, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, None, id="options-no-stream"
    ),
    pytest.param(CHAT, {"messages": []}, 400, "messages", id="chat-no-messages"),
    pytest.param(CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages", id="chat-bad-content"),
    pytest.param(CHAT, {"messages": [{"role": "user", "content": "x" * 400}]}, 400, None, id="chat-beyond-context"),
    pytest.param(CHAT, {"messages": HI, "max_completion_tokens": 0}, 400, None, id="chat-zero-max-tokens"),
    pytest.param(CHAT, {"messages": HI, "model": "no-such-model"}, 404, "model", id="chat-unknown-model"),
    pytest.param(CHAT, {"messages": HI, "top_logprobs": 2}, 400, None, id="top-logprobs-without-logprobs"),
    pytest.param(CHAT, {"messages": HI, "logprobs": 3}, 400, "logprobs", id="chat-logprobs-not-bool"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "logprobs": True}, 400, "logprobs", id="completion-logprobs-bool"),
    # Types are strict, as OpenAI's API checks them: no coercion from strings, numbers or floats.
    pytest.param(COMPLETIONS, {"prompt": "hi", "stream": "yes"}, 400, "stream", id="yes-is-not-a-boolean"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "echo": 1}, 400, "echo", id="one-is-not-a-boolean"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "max_tokens": 2.0}, 400, "max_tokens", id="float-token-count"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "seed": "7"}, 400, "seed", id="string-seed"),
    pytest.param(COMPLETIONS, {"prompt": "hi", "add_special_tokens": "no"}, 400, "add_special_tokens", id="special"),
    pytest.param(CHAT, {"messages": HI, "max_completion_tokens": 2.5}, 400, "max_completion_tokens", id="chat-float"),
    pytest.param(CHAT, {"messages": [{"role": "bogus", "content": "hi"}]}, 400, "messages", id="chat-bad-role"),
    pytest.param("/tokenize", {"prompt": "hi", "add_special_tokens": 0}, 400, "add_special_tokens", id="tok-bool"),
]

# Values that would reach the sampler and poison a batch, or overflow torch: each is a 400 naming its field.
# JSON has no NaN or infinity; Python's parser (and so the server's) reads them anyway, so they are sent raw.
HOSTILE = [
    ('"temperature": NaN', "temperature"),
    ('"temperature": Infinity', "temperature"),
    ('"temperature": -1e-9', "temperature"),
    ('"top_p": NaN', "top_p"),
    ('"top_p": 0', "top_p"),
    ('"top_p": 1.5', "top_p"),
    ('"top_k": -2', "top_k"),
    ('"top_k": 1000000000000000000000000000000', "top_k"),  # would not fit a message to the engine core
    ('"seed": 18446744073709551616', "seed"),  # 2**64
    ('"seed": -9223372036854775809', "seed"),  # -2**63 - 1
    ('"max_tokens": 100000000000000000000', None),  # beyond the context
    ('"presence_penalty": 2.5', "presence_penalty"),
    ('"frequency_penalty": -Infinity', "frequency_penalty"),
    ('"frequency_penalty": NaN', "frequency_penalty"),
    ('"repetition_penalty": 0', "repetition_penalty"),
    ('"repetition_penalty": Infinity', "repetition_penalty"),
    ('"logprobs": 21', "logprobs"),
    ('"logprobs": -1', "logprobs"),
    ('"stop": ["' + "x" * 513 + '"]', "stop"),
    ('"stop": [' + ",".join(f'"s{i}"' for i in range(33)) + "]", "stop"),
    ('"stop_token_ids": [-1]', "stop_token_ids"),
]

# OpenAI parameters this server does not implement, and a typo: refused by name, never silently ignored.
UNSUPPORTED = [
    (COMPLETIONS, "best_of", 2),
    (COMPLETIONS, "suffix", "end"),
    (COMPLETIONS, "logit_bias", {"50": 10}),
    (COMPLETIONS, "temprature", 0.5),
    (CHAT, "response_format", {"type": "json_object"}),
    (COMPLETIONS, "tools", [{"type": "function", "function": {"name": "f"}}]),
    (CHAT, "tool_choice", "auto"),
    (CHAT, "functions", [{"name": "f"}]),
    (CHAT, "logit_bias", {"50": 10}),
    (CHAT, "echo", True),
]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_input_is_a_clear_4xx_and_the_server_keeps_serving(server, client, model_name, path, body, status, param):
    send = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {}
    response = httpx.post(f"{server.url}{path}", **(send or {"json": body}), timeout=30)
    assert_openai_error(response, status, param)
    good = client.completions.create(model=model_name, prompt="hello", max_tokens=2)
    assert good.usage.completion_tokens >= 1


def test_a_bad_role_names_the_field_and_the_roles_taken(server):
    response = httpx.post(f"{server.url}{CHAT}", json={"messages": [{"role": "bogus", "content": "hi"}]}, timeout=30)
    assert_openai_error(response, 400, "messages")
    message = response.json()["error"]["message"]
    assert message.startswith("messages.0.role: role must be one of system, developer, user, assistant, not 'bogus'")


def test_the_openai_client_raises_its_own_error_types(client, model_name):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model_name, prompt="hi", max_tokens=1, temperature=-1)
    assert bad.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=HI)


def test_unknown_route_is_a_404_in_error_shape(server):
    assert_openai_error(httpx.get(f"{server.url}/v1/nothing-here"), 404)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("POST", COMPLETIONS),
        ("POST", CHAT),
        ("GET", "/metrics"),
        ("POST", "/reset_prefix_cache"),
    ],
)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", API_KEY], ids=["missing", "wrong", "no-bearer"])
def test_every_endpoint_but_health_needs_the_api_key(secured_server, method, path, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    response = httpx.request(method, f"{secured_server.url}{path}", headers=headers, content=b'{"prompt": ')
    assert_openai_error(response, 401)


def test_with_the_api_key_everything_works(secured_server):
    assert httpx.get(f"{secured_server.url}/health").status_code == 200
    client = openai.OpenAI(base_url=f"{secured_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == ["tiny", "alias"]
    out = client.completions.create(model="alias", prompt="hello", max_tokens=2)
    assert out.model == "alias"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{secured_server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_reset_prefix_cache_is_disabled_by_default(server):
    assert_openai_error(httpx.post(f"{server.url}/reset_prefix_cache"), 404)


def test_reset_prefix_cache_drops_cached_prefixes(secured_server):
    client = openai.OpenAI(base_url=f"{secured_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    prompt = random_prompt("reset", 21)

    def cached() -> int:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached() == 0
    assert cached() == 20
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(f"{secured_server.url}/reset_prefix_cache", headers=auth).json() == {"success": True}
    assert cached() == 0


def post_raw(url: str, path: str, body: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        f"{url}{path}", content=body.encode(), headers={"content-type": "application/json", **(headers or {})}
    )


async def post_all(url: str, bodies: list[str]) -> list[httpx.Response]:
    """Send raw JSON bodies to the completions endpoint all at once."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        headers = {"content-type": "application/json"}
        return await asyncio.gather(*(client.post(COMPLETIONS, content=b, headers=headers) for b in bodies))


def test_hostile_values_get_a_400_while_concurrent_streams_complete_untouched(server):
    """Before: a NaN temperature passed validation, raised inside the batch, and failed every stream."""
    streams, threads = start_streams(server.url, 3, max_tokens=240)
    refused = asyncio.run(post_all(server.url, ['{"prompt": "hi", "max_tokens": 4, ' + f + "}" for f, _ in HOSTILE]))
    refused_all = time.monotonic()
    # Valid extremes: a tiny temperature is greedy, seeds span torch's whole range.
    greedy = {"prompt": random_prompt("tiny-temperature", 8), "max_tokens": 8, "ignore_eos": True}
    # beside three streams on a loaded machine these may take longer than httpx's default 5 s: wait for them
    url = f"{server.url}{COMPLETIONS}"
    tiny = httpx.post(url, json={**greedy, "temperature": 1e-38, "cache_salt": "a"}, timeout=60)
    zero = httpx.post(url, json={**greedy, "temperature": 0, "cache_salt": "b"}, timeout=60)
    seeds = [httpx.post(url, json={**greedy, "seed": s}, timeout=60) for s in (2**64 - 1, -(2**63))]
    for thread in threads:
        thread.join(60)

    for (_, param), response in zip(HOSTILE, refused, strict=True):
        assert_openai_error(response, 400, param)
    assert tiny.status_code == zero.status_code == 200, (tiny.text, zero.text)
    assert tiny.json()["choices"][0]["text"] == zero.json()["choices"][0]["text"]
    assert [s.status_code for s in seeds] == [200, 200], [s.text for s in seeds]
    for stream in streams:
        assert stream.error is None and stream.done
        assert stream.ended_at > refused_all, "a stream ended before the hostile requests: the test proves nothing"
        assert all("error" not in event for event in stream.events), stream.events[-1]
        assert stream.events[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"]) for e in stream.events) == 240


@pytest.mark.parametrize(("path", "field", "value"), UNSUPPORTED, ids=[f"{p[4:8]}-{f}" for p, f, _ in UNSUPPORTED])
def test_unsupported_parameters_are_refused_by_name(server, path, field, value):
    body = {"prompt": "hi"} if path == COMPLETIONS else {"messages": HI}
    response = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 2, field: value})
    assert_openai_error(response, 400, field)
    assert field in response.json()["error"]["message"]
    assert "not implement" in response.json()["error"]["message"]


LONE_SURROGATE = '"a\\ud800b"'  # the JSON escape, as a client sends it


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, '{"prompt": %s}', "prompt"),
        (COMPLETIONS, '{"prompt": ["ok", %s]}', "prompt"),
        (COMPLETIONS, '{"prompt": "hi", "stop": [%s]}', "stop"),
        (COMPLETIONS, '{"prompt": "hi", "model": %s}', "model"),
        (COMPLETIONS, '{"prompt": "hi", "cache_salt": %s}', "cache_salt"),
        (CHAT, '{"messages": [{"role": "user", "content": %s}]}', "messages"),
        (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}', "messages"),
        (CHAT, '{"messages": [{"role": %s, "content": "hi"}]}', "messages"),
        ("/tokenize", '{"prompt": %s}', "prompt"),
    ],
)
def test_lone_surrogates_are_a_json_400(server, path, body, param):
    response = post_raw(server.url, path, body % LONE_SURROGATE)
    assert_openai_error(response, 400, param)
    assert "surrogate" in response.json()["error"]["message"]


def test_the_request_id_is_echoed_or_generated_and_names_the_response_and_the_log_line(server):
    body = {"prompt": random_prompt("request-id", 6), "max_tokens": 3, "ignore_eos": True}
    echoed = httpx.post(f"{server.url}{COMPLETIONS}", json=body, headers={"X-Request-Id": "client-id_42.a:b"})
    assert echoed.headers["x-request-id"] == "client-id_42.a:b"
    assert echoed.json()["id"] == "cmpl-client-id_42.a:b"
    generated = httpx.post(f"{server.url}{CHAT}", json={"messages": HI, "max_tokens": 2})
    assert generated.json()["id"] == f"chatcmpl-{generated.headers['x-request-id']}"
    for bad in ("x" * 129, "has space", "naïve"):
        response = httpx.post(f"{server.url}{COMPLETIONS}", json=body, headers={"X-Request-Id": bad.encode()})
        assert_openai_error(response, 400, "X-Request-Id")
        assert response.headers["x-request-id"] != bad  # a fresh id, not the refused one
    refused = httpx.post(
        f"{server.url}{COMPLETIONS}", json={**body, "temperature": -1}, headers={"X-Request-Id": "bad-1"}
    )
    assert_openai_error(refused, 400, "temperature")

    def logged(request_id: str) -> list[str]:
        return [line for line in server.log().splitlines() if f"request_id={request_id} " in line]

    # the line is written once the response is sent, so it may land just after the client has it
    wait_until(lambda: logged("client-id_42.a:b") and logged("bad-1"), what="the request log lines")
    [line] = logged("client-id_42.a:b")
    assert "POST /v1/completions 200 prompt_tokens=6 cached_tokens=0 generated_tokens=3 ttft=" in line
    assert "finish=length" in line
    [line] = logged("bad-1")
    assert "POST /v1/completions 400" in line and 'error="temperature must be a finite number' in line


def test_an_unhandled_exception_is_an_openai_shaped_500_with_the_traceback_logged(caplog):
    """Our own bugs: no route raises on purpose, so the middleware is driven directly."""

    async def buggy(scope, receive, send):
        raise RuntimeError("a bug")

    app = RequestContextMiddleware(buggy)

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "bug-1"})

    with caplog.at_level(logging.INFO, logger="prefixcache.server"):
        response = asyncio.run(call())
    assert_openai_error(response, 500)
    assert response.json()["error"]["type"] == "server_error"
    assert "bug-1" in response.json()["error"]["message"] and response.headers["x-request-id"] == "bug-1"
    failure = next(r for r in caplog.records if r.name == "prefixcache.http.middleware")
    assert failure.exc_info is not None and "a bug" in str(failure.exc_info[1])
    assert any("request_id=bug-1 POST /v1/completions 500" in r.getMessage() for r in caplog.records)
