"""The router in front of backends started with ``--api-key``: its own calls carry ``--backend-api-key``,
client requests carry the client's key, and prompts are hashed with the tenant salt the backends use."""

import argparse
import asyncio
import json
import logging

import httpx
import pytest

from prefixcache.core import FULL_ATTENTION, KVCacheGroupSpec
from prefixcache.core.kv_cache_groups import RECURRENT_STATE
from prefixcache.core.tenant_salt import SALT_BY_API_KEY, engine_salt, tenant_salt
from prefixcache.router.app import RouterSettings
from prefixcache.router.backend_config import CacheConfig, hashing_mismatch, parse_cache_config
from prefixcache.router.backends import BackendPool, BackendRefusedError, HealthSettings
from prefixcache.router.cli import BACKEND_API_KEY_ENV, backend_api_key
from prefixcache.router.index import PrefixIndex
from prefixcache.router.metrics import RouterMetrics
from tests.helpers import wait_until
from tests.router.fakes import (
    BLOCK_SIZE,
    PROMPT,
    cache_config,
    complete,
    event_hashes,
    index_blocks,
    metric,
    served_by,
    stored,
)

ROUTER_KEY = "router-key"


def keyed(name, backend, events=None, api_key=ROUTER_KEY):
    return backend(name, events, api_key=api_key, tenant_salt=SALT_BY_API_KEY)


def test_each_tenant_is_hashed_with_its_keys_salt(backend, publisher, router):
    pub_a, pub_b = publisher(), publisher()
    a, b = keyed("a", backend, pub_a), keyed("b", backend, pub_b)
    r = router([a, b], backend_api_key=ROUTER_KEY, affinity_balance=0)
    # a holds the prompt for tenant key-1, b for tenant key-2 with its own cache_salt "s" on top
    pub_a.publish([stored(event_hashes(PROMPT[:16], cache_salt=tenant_salt("key-1")))])
    pub_b.publish([stored(event_hashes(PROMPT[:16], cache_salt=engine_salt(tenant_salt("key-2"), "s")))])
    wait_until(lambda: index_blocks(r, a) == 4 and index_blocks(r, b) == 4, what="both backends' blocks")

    assert served_by(complete(r, api_key="key-1")) == a.url
    assert served_by(complete(r, api_key="key-2", cache_salt="s")) == b.url
    assert metric(r, "predicted_cached_tokens_total", a) == metric(r, "predicted_cached_tokens_total", b) == 16
    # key-2 without its salt, a third tenant, a tenant naming another's salt, and no key at all: nothing is
    # predicted anywhere, so the two backends take turns
    for api_key, extra in (("key-2", {}), ("key-3", {}), ("key-1", {"cache_salt": tenant_salt("key-2")}), (None, {})):
        assert {served_by(complete(r, api_key=api_key, **extra)) for _ in range(4)} == {a.url, b.url}
    assert metric(r, "predicted_cached_tokens_total") == 32
    # each request reached its backend with the client's own Authorization, never the router's key
    sent = a.authorizations + b.authorizations
    assert sent.count(None) == 4 and f"Bearer {ROUTER_KEY}" not in sent
    assert a.authorizations[0] == "Bearer key-1" and b.authorizations[0] == "Bearer key-2"


def test_a_backend_that_refuses_the_routers_key_stays_out_with_the_401_in_the_log(backend, router, caplog):
    caplog.set_level(logging.INFO, logger="prefixcache.router")
    a, b = keyed("a", backend), keyed("b", backend, api_key="another-key")
    r = router([a, b], backend_api_key=ROUTER_KEY, interval=0.05, affinity_balance=0)
    wait_until(lambda: b.config_requests >= 4, what="b asked again at later health checks")
    errors = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    lines = [line for line in errors if b.url in line]
    assert lines == [
        f"backend {b.url} stays out of the rotation: /v1/cache/config answered 401 Unauthorized: "
        "the backend does not accept the router's --backend-api-key"
    ]  # once, not at every health check
    assert ROUTER_KEY not in caplog.text
    assert {served_by(complete(r, api_key="key-1")) for _ in range(3)} == {a.url}
    assert metric(r, "backend_up", b) == 0
    b.api_key = ROUTER_KEY  # the backend gets the router's key: it joins at the next health check
    wait_until(lambda: metric(r, "backend_up", b) == 1, what="b joining the rotation")
    assert {served_by(complete(r, api_key="key-1")) for _ in range(4)} == {a.url, b.url}


def test_without_a_backend_key_keyed_backends_stay_out_and_the_log_says_what_to_give(backend, router, caplog):
    caplog.set_level(logging.ERROR, logger="prefixcache.router")
    a = keyed("a", backend)
    r = router([a])
    assert "/v1/cache/config answered 401 Unauthorized: the backend wants an API key; give the router " in caplog.text
    assert httpx.get(f"{r.url}/health").status_code == 503
    assert complete(r, api_key=ROUTER_KEY).status_code == 503


def test_backends_that_salt_differently_are_not_mixed(backend):
    a, b = keyed("a", backend), backend("b", api_key=ROUTER_KEY)

    async def start() -> None:
        async with httpx.AsyncClient() as client:
            pool = BackendPool([a.url, b.url], PrefixIndex(), RouterMetrics(), client, HealthSettings(), ROUTER_KEY)
            await pool.start()

    with pytest.raises(BackendRefusedError, match=r"tenant_salt is None, the other backends use 'api_key'"):
        asyncio.run(start())


def parsed(config: dict) -> CacheConfig:
    return parse_cache_config(json.dumps(config).encode())


def test_the_cache_config_says_how_requests_are_salted():
    older = cache_config()
    del older["tenant_salt"]
    assert not parsed(older).keyed  # a server from before tenant_salt: not keyed
    assert parsed(cache_config(tenant_salt=SALT_BY_API_KEY)).keyed
    assert hashing_mismatch(parsed(older), parsed(cache_config(tenant_salt=SALT_BY_API_KEY))) == (
        "tenant_salt is 'api_key', the other backends use None"
    )
    with pytest.raises(ValueError, match=r"tenant_salt 'user' is unknown to this router"):
        parsed(cache_config(tenant_salt="user"))


def test_the_cache_config_reports_the_kv_cache_groups_each_spec_or_none_for_an_unknown_kind():
    def group(idx, kind, window=None, block_size=BLOCK_SIZE) -> dict:
        return {"group_idx": idx, "kind": kind, "block_size": block_size, "sliding_window": window}

    assert parsed(cache_config()).group_specs == ()  # a server from before kv_cache_groups: learned from events
    groups = [group(0, "sliding_window", 32), group(1, "full_attention"), group(2, "chunked_local_attention")]
    assert parsed(cache_config(kv_cache_groups=groups)).group_specs == (KVCacheGroupSpec(32), FULL_ATTENTION, None)
    groups = [group(0, "full_attention"), group(1, "mamba")]  # a hybrid's recurrent state: its checkpoints
    assert parsed(cache_config(kv_cache_groups=groups)).group_specs == (FULL_ATTENTION, RECURRENT_STATE)
    for bad, message in (
        ([group(1, "full_attention")], "kv_cache_groups\\[0\\] is group 1"),
        ([group(0, "full_attention", block_size=16)], "of blocks of 16 tokens, not group 0 of 4"),
        ([group(0, "sliding_window")], "a sliding_window group needs its sliding window"),
        ([group(0, "sliding_window", 0)], "sliding_window must be a positive integer"),
    ):
        with pytest.raises(ValueError, match=message):
            parsed(cache_config(kv_cache_groups=bad))


def test_the_backend_key_comes_from_the_flag_else_the_environment_and_is_never_shown():
    def args(key=None) -> argparse.Namespace:
        return argparse.Namespace(backend_api_key=key)

    assert backend_api_key(args("flag"), {BACKEND_API_KEY_ENV: "env"}) == "flag"
    assert backend_api_key(args(), {BACKEND_API_KEY_ENV: "env"}) == "env"
    assert backend_api_key(args(), {BACKEND_API_KEY_ENV: ""}) is None
    settings = RouterSettings(backends=("http://b:8000",), backend_api_key="secret-key")
    assert "secret-key" not in repr(settings)
    for bad in ("", "two words", "naïve"):
        with pytest.raises(ValueError, match="backend API key must be non-empty printable ASCII"):
            RouterSettings(backends=("http://b:8000",), backend_api_key=bad)
