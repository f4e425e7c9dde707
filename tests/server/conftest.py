"""Two real servers on the tiny model, started together once per session: plain, and with two API keys
(two tenants), a metrics key and reset."""

import httpx
import openai
import pytest

from tests.server.harness import API_KEY, METRICS_API_KEY, OTHER_API_KEY, SERVER_ARGS, ServerProcess

SECURED_MAX_RETENTION_TTL_S = 1800  # half of cache_control's "1h": the secured server clamps it


@pytest.fixture(scope="session")
def _servers(tiny_llama_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("server-logs")
    plain = ServerProcess(tiny_llama_dir, SERVER_ARGS, logs / "plain.log")
    secured = ServerProcess(
        tiny_llama_dir,
        [
            *SERVER_ARGS,
            *("--api-key", API_KEY, "--api-key", OTHER_API_KEY, "--metrics-api-key", METRICS_API_KEY),
            *("--enable-reset-prefix-cache", "--served-model-name", "tiny", "alias"),
            *("--max-retention-ttl", str(SECURED_MAX_RETENTION_TTL_S)),
        ],
        logs / "secured.log",
    )
    try:
        plain.wait_ready()
        secured.wait_ready()
        yield plain, secured
    finally:
        plain.stop()
        secured.stop()


@pytest.fixture(scope="session")
def server(_servers) -> ServerProcess:
    """Default flags: no API key, cache reset disabled."""
    return _servers[0]


@pytest.fixture(scope="session")
def secured_server(_servers) -> ServerProcess:
    """``--api-key`` twice (``API_KEY``, ``OTHER_API_KEY``), ``--metrics-api-key METRICS_API_KEY``,
    ``--enable-reset-prefix-cache`` and ``--max-retention-ttl SECURED_MAX_RETENTION_TTL_S``; served as ``tiny``
    and ``alias``."""
    return _servers[1]


@pytest.fixture(scope="session")
def model_name(server) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
