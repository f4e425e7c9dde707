"""Fake backends, fake KV event publishers and a router in front of them, all on loopback; all stopped."""

import pytest

from prefixcache.router.app import RouterSettings, build_app
from prefixcache.router.backends import HealthSettings
from prefixcache.router.policy import DEFAULT_AFFINITY_BALANCE
from tests.router.fakes import BLOCK_SIZE, HANG_S, FakeBackend, FakePublisher, FakeVllm, ThreadedServer, cache_config


@pytest.fixture
def stoppables():
    started = []
    yield started
    for thing in reversed(started):
        thing.stop()


@pytest.fixture
def publisher(stoppables):
    def make() -> FakePublisher:
        pub = FakePublisher()
        stoppables.append(pub)
        return pub

    return make


@pytest.fixture
def backend(stoppables):
    def make(name: str, events: FakePublisher | None = None, api_key: str | None = None, **config) -> FakeBackend:
        if events is not None:
            config["kv_events"] = events.kv_events()
        fake = FakeBackend(name, cache_config(**config), api_key)
        stoppables.append(fake)
        return fake

    return make


@pytest.fixture
def vllm(stoppables):
    def make(name: str, **options) -> FakeVllm:
        fake = FakeVllm(name, **options)
        stoppables.append(fake)
        return fake

    return make


@pytest.fixture
def router(stoppables):
    """A started router app in a thread; health checks rare unless asked, so tests drive them.
    ``affinity_balance=0`` turns affinity off: backends predicted alike then take turns."""

    def make(
        backends,
        policy="prefix",
        tokenizer=None,
        interval=3600.0,
        prefix_weight=64.0,
        backend_api_key=None,
        affinity_balance=DEFAULT_AFFINITY_BALANCE,
        event_sources=(),
        kv_event_block_size=BLOCK_SIZE,
    ) -> ThreadedServer:
        settings = RouterSettings(
            backends=tuple(b.url for b in backends),
            policy=policy,
            prefix_weight=prefix_weight,
            health=HealthSettings(interval=interval, timeout=HANG_S, failures_to_down=1, replay_timeout=HANG_S),
            backend_api_key=backend_api_key,
            affinity_balance=affinity_balance,
            event_sources=tuple(event_sources),
            kv_event_block_size=kv_event_block_size,
        )
        server = ThreadedServer(build_app(settings, tokenizer))
        stoppables.append(server)
        return server

    return make
