"""Handlers alone: each route module mounted on an app of its own, with a stand-in engine on ``app.state``
(no core process, no model), as a newcomer would test a new handler."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import msgspec
from fastapi import FastAPI

from prefixcache.core import FULL_ATTENTION, KVCacheGroupSpec
from prefixcache.engine.messages import EngineInfo
from prefixcache.kv_events.config import KVEventsConfig
from prefixcache.server.errors import install_error_handlers
from prefixcache.server.routes import cache, info
from prefixcache.server.settings import ServerSettings

ENGINE_INFO = EngineInfo(
    model_name="tiny",
    max_model_len=256,
    vocab_size=512,
    block_size=4,
    num_blocks=64,
    hash_algo="sha256",
    hash_seed="prefixcache",
    enable_prefix_caching=True,
    kv_capacity_tokens=256,
)


def engine(accepting: bool = True, kv_events: KVEventsConfig | None = None) -> SimpleNamespace:
    """What these handlers read of ``AsyncLLM``."""
    return SimpleNamespace(info=ENGINE_INFO, accepting=accepting, config=SimpleNamespace(kv_events_config=kv_events))


def app_with(router, engine: SimpleNamespace, settings: ServerSettings) -> FastAPI:
    app = FastAPI()
    app.state.engine, app.state.settings, app.state.started = engine, settings, 0
    install_error_handlers(app)
    app.include_router(router)
    return app


def get(app: FastAPI, path: str) -> httpx.Response:
    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.get(path)

    return asyncio.run(call())


def test_cache_config_says_how_the_cache_is_keyed_by_the_settings():
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558")
    plain = get(app_with(cache.router, engine(), ServerSettings(("tiny",))), "/v1/cache/config").json()
    assert plain == {
        "model": "tiny",
        "max_model_len": 256,
        "block_size": 4,
        "num_blocks": 64,
        "hash_algo": "sha256",
        "hash_seed": "prefixcache",
        "enable_prefix_caching": True,
        "tenant_salt": None,
        "kv_cache_groups": [{"group_idx": 0, "kind": "full_attention", "block_size": 4, "sliding_window": None}],
        "recurrent_state": None,
        "kv_events": None,
    }
    keyed = app_with(cache.router, engine(kv_events=events), ServerSettings(("tiny",), api_keys=("k",)))
    answer = get(keyed, "/v1/cache/config").json()
    assert answer["tenant_salt"] == "api_key"
    assert answer["kv_events"] == {
        "endpoint": "tcp://*:5557",
        "endpoint_bound": True,
        "replay_endpoint": "tcp://*:5558",
        "topic": "",
    }
    connecting = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://10.0.0.9:5557")
    answer = get(app_with(cache.router, engine(kv_events=connecting), ServerSettings(("tiny",))), "/v1/cache/config")
    assert answer.json()["kv_events"]["endpoint_bound"] is False
    shared = ServerSettings(("tiny",), api_keys=("k",), share_cache_across_keys=True)
    assert get(app_with(cache.router, engine(), shared), "/v1/cache/config").json()["tenant_salt"] is None


def test_cache_config_lists_a_hybrid_models_kv_cache_groups_in_order():
    groups = (KVCacheGroupSpec(32), FULL_ATTENTION, KVCacheGroupSpec(32))
    hybrid = SimpleNamespace(info=msgspec.structs.replace(ENGINE_INFO, kv_cache_groups=groups), config=engine().config)
    answer = get(app_with(cache.router, hybrid, ServerSettings(("tiny",))), "/v1/cache/config").json()
    assert answer["kv_cache_groups"] == [
        {"group_idx": 0, "kind": "sliding_window", "block_size": 4, "sliding_window": 32},
        {"group_idx": 1, "kind": "full_attention", "block_size": 4, "sliding_window": None},
        {"group_idx": 2, "kind": "sliding_window", "block_size": 4, "sliding_window": 32},
    ]


def test_health_follows_the_engine_and_models_lists_every_served_name():
    settings = ServerSettings(("tiny", "alias"))
    assert get(app_with(info.router, engine(), settings), "/health").status_code == 200
    assert get(app_with(info.router, engine(accepting=False), settings), "/health").status_code == 503
    models = get(app_with(info.router, engine(), settings), "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny", "alias"]
    assert {m["max_model_len"] for m in models["data"]} == {256}
