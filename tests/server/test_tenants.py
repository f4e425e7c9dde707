"""API keys are tenants: requests of different keys never share cached blocks (cached_tokens and TTFT would
tell one tenant what another sent), the same key does, and ``--share-cache-across-keys`` opts into sharing."""

import argparse

import httpx
import openai
import pytest

from prefixcache.core.tenant_salt import SALT_BY_API_KEY
from prefixcache.server.cli import API_KEY_ENV, api_keys
from tests.server.harness import API_KEY, METRICS_API_KEY, OTHER_API_KEY, SERVER_ARGS, ServerProcess, random_prompt


def cached_tokens(url: str, key: str, prompt: list[int], salt: str | None = None) -> int:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)
    extra = {"cache_salt": salt} if salt else {}
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body=extra)
    return out.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def sharing_server(tiny_llama_dir, tmp_path_factory):
    """Two keys from a keys file, with the cache shared across them."""
    directory = tmp_path_factory.mktemp("sharing")
    keys = directory / "keys.txt"
    keys.write_text(f"# tenants\n{API_KEY}\n\n{OTHER_API_KEY}  # the second one\n")
    server = ServerProcess(
        tiny_llama_dir,
        [*SERVER_ARGS, "--api-key-file", str(keys), "--share-cache-across-keys", "--served-model-name", "tiny"],
        directory / "server.log",
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_two_keys_never_share_cached_tokens_and_the_same_key_does(secured_server):
    url = secured_server.url
    prompt = random_prompt("tenant-pin", 41)  # at most 40 tokens (ten 4-token blocks) can be served from cache
    assert cached_tokens(url, API_KEY, prompt) == 0
    assert cached_tokens(url, OTHER_API_KEY, prompt) == 0  # the other tenant cannot see the first one's prompt
    assert cached_tokens(url, API_KEY, prompt) == 40
    assert cached_tokens(url, OTHER_API_KEY, prompt) == 40  # its own copy
    # A request's own salt stays inside its tenant: naming the same salt reaches no other tenant's blocks.
    assert cached_tokens(url, API_KEY, prompt, salt="shared-name") == 0
    assert cached_tokens(url, OTHER_API_KEY, prompt, salt="shared-name") == 0
    assert cached_tokens(url, API_KEY, prompt, salt="shared-name") == 40
    log = secured_server.log()
    assert API_KEY not in log and OTHER_API_KEY not in log


def test_the_opt_in_flag_shares_the_cache_across_keys(sharing_server):
    url = sharing_server.url
    prompt = random_prompt("tenant-shared", 41)
    assert cached_tokens(url, API_KEY, prompt) == 0
    assert cached_tokens(url, OTHER_API_KEY, prompt) == 40
    with pytest.raises(openai.AuthenticationError):
        cached_tokens(url, "# tenants", prompt)  # a comment line of the keys file is no key


def test_keys_come_from_the_flags_and_the_file_else_the_environment(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("k2\n# comment\n  k3  \nk1\n")

    def args(keys=None, path=None) -> argparse.Namespace:
        return argparse.Namespace(api_key=keys, api_key_file=path)

    assert api_keys(args(["k1", "k2"], keys_file), {API_KEY_ENV: "env"}) == ("k1", "k2", "k3")
    assert api_keys(args(), {API_KEY_ENV: "env"}) == ("env",)
    assert api_keys(args(), {}) == ()


def test_the_cache_config_says_whether_keys_are_tenants(server, secured_server, sharing_server):
    def salted_by(url: str) -> str | None:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        return httpx.get(f"{url}/v1/cache/config", headers=headers, timeout=10).json()["tenant_salt"]

    assert salted_by(secured_server.url) == SALT_BY_API_KEY
    assert salted_by(sharing_server.url) is None  # --share-cache-across-keys
    assert salted_by(server.url) is None  # no keys


def test_tenants_keys_do_not_reach_metrics_which_takes_the_metrics_key_alone(secured_server):
    """Before: /metrics took any tenant's key, and its counters move with every tenant's hits."""
    url = f"{secured_server.url}/metrics"
    for key in (API_KEY, OTHER_API_KEY, None, "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.get(url, headers=headers)
        assert response.status_code == 401, key
        assert "--metrics-api-key" in response.json()["error"]["message"]
    metrics = httpx.get(url, headers={"Authorization": f"Bearer {METRICS_API_KEY}"})
    assert metrics.status_code == 200 and "prefixcache:prefix_cache_queries_total" in metrics.text
    # the metrics key is no tenant: it reaches nothing else
    models = httpx.get(f"{secured_server.url}/v1/models", headers={"Authorization": f"Bearer {METRICS_API_KEY}"})
    assert models.status_code == 401


def test_a_metrics_key_alone_guards_metrics_and_leaves_the_api_open():
    import asyncio

    from prefixcache.http.middleware import APIKeyMiddleware

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    app = APIKeyMiddleware(ok, api_keys=(), metrics_key="m-key")

    async def statuses() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return [
                (await client.get("/v1/models")).status_code,
                (await client.get("/metrics")).status_code,
                (await client.get("/metrics", headers={"Authorization": "Bearer m-key"})).status_code,
            ]

    assert asyncio.run(statuses()) == [200, 401, 200]


def test_the_metrics_key_must_differ_from_the_tenants_keys():
    from prefixcache.server.settings import ServerSettings

    with pytest.raises(ValueError, match="differ"):
        ServerSettings(("m",), api_keys=("a", "b"), metrics_api_key="b")
    with pytest.raises(ValueError, match="printable"):
        ServerSettings(("m",), metrics_api_key="has space")
