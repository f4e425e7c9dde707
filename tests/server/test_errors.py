"""Bad input gets a 4xx in OpenAI's error shape and the server keeps serving; auth and the reset switch."""

import httpx
import openai
import pytest

from tests.server.harness import API_KEY, random_prompt

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
    pytest.param(COMPLETIONS, {"prompt": "hi", "n": 2}, 400, "n", id="n-above-1"),
    pytest.param(
        COMPLETIONS, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, None, id="options-no-stream"
    ),
    pytest.param(CHAT, {"messages": []}, 400, "messages", id="chat-no-messages"),
    pytest.param(CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages", id="chat-bad-content"),
    pytest.param(CHAT, {"messages": [{"role": "user", "content": "x" * 400}]}, 400, None, id="chat-beyond-context"),
    pytest.param(CHAT, {"messages": HI, "max_completion_tokens": 0}, 400, None, id="chat-zero-max-tokens"),
    pytest.param(CHAT, {"messages": HI, "model": "no-such-model"}, 404, "model", id="chat-unknown-model"),
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
