"""The backends behind the router: what kind each one is, whether it is in the rotation, its load.

Three kinds, told apart at admission by ``GET /v1/cache/config``:

- ``prefixcache``: a ``prefixcache serve`` answering it. Its hashing must match the others' (the first
  listed one that answers sets the reference; one that differs is refused and re-examined at each health
  check), and its events' hashes are the index's keys (exact prediction); the KV cache groups it reports
  (a hybrid model's sliding and full layers) are its own.
- ``kv-events``: no such path (404), but ``--kv-event-source`` names where it publishes KV events (a vLLM
  server started with ``--kv-events-config``): indexed by the content of its events
  (:class:`~prefixcache.router.blocks.ContentKeyedBlocks`). Events with another block size than the
  router's ``--kv-event-block-size`` refuse it for as long as the router runs, with the flag to change.
- ``load``: no such path and no event source (any OpenAI-compatible server): routed by load and affinity,
  never by a guessed cache.

A backend enters the rotation once ``/health`` answers 200. One whose config cannot be fetched (an error
status other than 404, such as 401 for a missing or wrong ``--backend-api-key``) waits out of the rotation
and is asked again at each health check. It leaves when health checks fail ``failures_to_down`` times in a
row, or at once when a request cannot reach it; leaving drops its index entries, since they may be
stale by the time it returns. A subscribed backend that serves requests and sends no event at all is
warned about once per subscription (an endpoint nobody publishes on). The router's own calls carry its
``api_key`` as a bearer token; the requests it forwards carry only the client's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
import zmq.asyncio

from prefixcache.http.auth import BEARER
from prefixcache.router.backend_config import (
    CACHE_CONFIG_PATH,
    CacheConfig,
    connect_address,
    hashing_mismatch,
    parse_cache_config,
)
from prefixcache.router.blocks import ContentKeyedBlocks, EngineKeyedBlocks
from prefixcache.router.index import PrefixIndex
from prefixcache.router.metrics import RouterMetrics
from prefixcache.router.subscriber import EventSource, EventSubscriber
from prefixcache.router.wire import DEFAULT_CONTENT_BLOCK_SIZE

logger = logging.getLogger(__name__)

ENGINE = "prefixcache"
CONTENT = "kv-events"
LOAD = "load"
# Requests with whole blocks a subscribed backend serves without a single event before the router warns.
SILENT_AFTER_REQUESTS = 3


class BackendRefusedError(RuntimeError):
    """A reachable backend hashes prompts differently from the others; the router will not start."""


@dataclass(frozen=True, slots=True)
class HealthSettings:
    interval: float = 5.0
    timeout: float = 2.0
    failures_to_down: int = 2
    replay_timeout: float = 5.0

    def __post_init__(self) -> None:
        if self.interval <= 0 or self.timeout <= 0 or self.replay_timeout <= 0:
            raise ValueError("health-check interval and timeouts must be positive")
        if self.failures_to_down < 1:
            raise ValueError(f"failures_to_down must be >= 1, got {self.failures_to_down}")


@dataclass(slots=True, eq=False)
class Backend:
    """``events`` is where ``--kv-event-source`` says it publishes; ``kind`` is known once it was admitted."""

    url: str
    events: EventSource | None = None
    kind: str | None = None
    up: bool = False
    refused: str | None = None
    events_refused: bool = False  # refused by what its events say: not re-examined
    config_error: str | None = None  # why /v1/cache/config could not be fetched the last time it was asked
    failures: int = 0
    tokens_in_flight: int = 0
    requests_in_flight: int = 0
    subscriber: EventSubscriber | None = None
    served_since_subscribed: int = 0
    silence_warned: bool = False

    @property
    def routable(self) -> bool:
        return self.up and self.refused is None

    @property
    def lora_names(self) -> set[str]:
        """Adapters its content-keyed events named."""
        blocks = self.subscriber.blocks if self.subscriber is not None else None
        return blocks.lora_names if isinstance(blocks, ContentKeyedBlocks) else set()

    def finished(self, had_blocks: bool) -> None:
        """A request routed here ended; one with whole blocks should have made a subscribed backend publish."""
        subscriber = self.subscriber
        if subscriber is None or not had_blocks:
            return
        self.served_since_subscribed += 1
        if subscriber.batches_applied or self.silence_warned or self.served_since_subscribed < SILENT_AFTER_REQUESTS:
            return
        self.silence_warned = True
        source = subscriber.source
        logger.warning(
            "backend %s served %d requests but sent no KV event on %s: nothing publishes there, so its cache is "
            "not predicted (routed by load). Check its --kv-events-config: an endpoint like tcp://HOST:PORT is "
            "connected to, not bound; bind tcp://*:PORT (or ipc://PATH on one host) and point the router there",
            self.url,
            self.served_since_subscribed,
            source.endpoint,
        )


class BackendPool:
    def __init__(
        self,
        urls: list[str],
        index: PrefixIndex,
        metrics: RouterMetrics,
        client: httpx.AsyncClient,
        health: HealthSettings = HealthSettings(),
        api_key: str | None = None,
        event_sources: Mapping[str, EventSource] | None = None,
        content_block_size: int = DEFAULT_CONTENT_BLOCK_SIZE,
    ) -> None:
        """``event_sources``: backend URL -> where it publishes (for backends without /v1/cache/config, or to
        override what one reports); ``content_block_size``: the block size content-keyed events must carry."""
        if not urls:
            raise ValueError("the router needs at least one backend")
        normalized = [url.rstrip("/") for url in urls]
        if len(set(normalized)) != len(normalized):
            raise ValueError("a backend URL is given twice")
        sources = {url.rstrip("/"): source for url, source in (event_sources or {}).items()}
        self.backends = [Backend(url, sources.get(url)) for url in normalized]
        self.content_block_size = content_block_size
        self.index = index
        self.metrics = metrics
        self.client = client
        self.health = health
        self._auth = {"Authorization": f"{BEARER}{api_key}"} if api_key is not None else {}
        self.reference: CacheConfig | None = None
        self._context: zmq.asyncio.Context | None = None
        self._loop_task: asyncio.Task[None] | None = None

    def routable(self) -> list[Backend]:
        return [b for b in self.backends if b.routable]

    async def start(self) -> None:
        """Probe every backend once and start the health checks; raises BackendRefusedError on a mismatch."""
        self._context = zmq.asyncio.Context()
        for backend in self.backends:  # in order: the first one that answers sets the reference
            await self.probe(backend)
        refused = [f"{b.url}: {b.refused}" for b in self.backends if b.refused]
        if refused:
            await self.stop()
            raise BackendRefusedError("backends hash prompts differently: " + "; ".join(refused))
        if not self.routable():
            logger.warning("no backend is up yet; requests get 503 until one passes a health check")
        self._loop_task = asyncio.create_task(self._check_forever(), name="router health checks")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        for backend in self.backends:
            await self._stop_events(backend)
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    async def probe(self, backend: Backend) -> None:
        """One health check: a backend not in the rotation (or refused) is (re)examined when it answers."""
        try:
            response = await self.client.get(f"{backend.url}/health", headers=self._auth, timeout=self.health.timeout)
            healthy = response.status_code == 200
            reason = f"/health answered {response.status_code}"
        except httpx.HTTPError as exc:
            healthy, reason = False, f"{type(exc).__name__}: {exc}"
        if not healthy:
            await self.failed(backend, reason)
            return
        backend.failures = 0
        if not backend.routable and not backend.events_refused:
            await self._admit(backend)

    async def failed(self, backend: Backend, reason: str) -> None:
        backend.failures += 1
        if backend.up and backend.failures >= self.health.failures_to_down:
            await self.take_down(backend, reason)

    async def take_down(self, backend: Backend, reason: str) -> None:
        """Out of the rotation now; its index entries go (they may be stale when it returns).

        Leaving the rotation and clearing the index happen in one step of the event loop, so nothing (a route, a
        /metrics scrape) sees the backend out with entries left. No event lands after the clear: stopping the
        subscriber cancels its task before its first await, and a cancelled task applies nothing more."""
        if not backend.up:
            return
        logger.warning("backend %s leaves the rotation: %s", backend.url, reason)
        backend.up = False
        self.index.clear(backend.url)
        self.metrics.backend_up.labels(backend.url).set(0)
        await self._stop_events(backend)

    async def _admit(self, backend: Backend) -> None:
        url = f"{backend.url}{CACHE_CONFIG_PATH}"
        try:
            response = await self.client.get(url, headers=self._auth, timeout=self.health.timeout)
        except httpx.HTTPError as exc:
            self._config_failed(backend, f"cannot read {CACHE_CONFIG_PATH}: {type(exc).__name__}: {exc}")
            return
        if response.status_code == 404:  # not a prefixcache server
            backend.config_error = None
            self._admit_foreign(backend)
            return
        if response.status_code != 200:
            reason = f"{CACHE_CONFIG_PATH} answered {response.status_code} {response.reason_phrase}"
            if response.status_code in (401, 403):
                reason += ": " + self._key_hint()
            self._config_failed(backend, reason)
            return
        backend.config_error = None
        try:
            config = parse_cache_config(response.content)
        except ValueError as exc:
            backend.refused = f"cannot read {CACHE_CONFIG_PATH}: {exc}"
            logger.error("backend %s refused: %s", backend.url, backend.refused)
            return
        if self.reference is None:
            self.reference = config
        backend.refused = hashing_mismatch(self.reference, config)
        if backend.refused:
            logger.error("backend %s refused: %s", backend.url, backend.refused)
            return
        backend.kind = ENGINE
        source = backend.events or self._reported_source(backend, config)
        blocks = EngineKeyedBlocks(self.index, backend.url, config.block_size, config.group_specs)
        self._join(backend, source, blocks)

    def _admit_foreign(self, backend: Backend) -> None:
        if backend.events is None:
            backend.kind = LOAD
            self._join(backend, None, None)
            return
        backend.kind = CONTENT
        blocks = ContentKeyedBlocks(self.index, backend.url, self.metrics, self.content_block_size)
        self._join(backend, backend.events, blocks)

    def _join(self, backend: Backend, source: EventSource | None, blocks: EngineKeyedBlocks | None) -> None:
        backend.up = True
        self.metrics.backend_up.labels(backend.url).set(1)
        logger.info("backend %s joins the rotation (%s)", backend.url, self._join_text(backend, source))
        if source is None or blocks is None or self._context is None:
            return
        backend.subscriber = EventSubscriber(
            backend.url,
            source,
            blocks,
            self.metrics,
            self._context,
            self.health.replay_timeout,
            lambda reason: self._refuse_events(backend, reason),
        )
        backend.served_since_subscribed = 0
        backend.silence_warned = False
        backend.subscriber.start()

    def _join_text(self, backend: Backend, source: EventSource | None) -> str:
        if source is None:
            if backend.kind == LOAD:
                return f"no {CACHE_CONFIG_PATH} and no --kv-event-source: routed by load and affinity"
            return "no KV events: routed by load and affinity"
        replay = f", replay from {source.replay_endpoint}" if source.replay_endpoint else ", no replay"
        keyed = "" if backend.kind == ENGINE else f"; keyed by content, blocks of {self.content_block_size} tokens"
        return f"subscribing to KV events at {source.endpoint}{replay}{keyed}"

    def _refuse_events(self, backend: Backend, reason: str) -> None:
        """Its events cannot describe the router's prompts: out of the rotation until the router restarts."""
        backend.refused = reason
        backend.events_refused = True
        self.index.clear(backend.url)
        self.metrics.backend_up.labels(backend.url).set(0)
        logger.error("backend %s refused: %s", backend.url, reason)

    def _key_hint(self) -> str:
        if self._auth:
            return "the backend does not accept the router's --backend-api-key"
        return "the backend wants an API key; give the router --backend-api-key"

    @staticmethod
    def _config_failed(backend: Backend, reason: str) -> None:
        """Logged when the reason changes, not at every health check while it lasts."""
        if reason != backend.config_error:
            logger.error("backend %s stays out of the rotation: %s", backend.url, reason)
        backend.config_error = reason

    @staticmethod
    def _reported_source(backend: Backend, config: CacheConfig) -> EventSource | None:
        """Where a prefixcache backend says it publishes, as an address to connect to; None when it does not."""
        events = config.kv_events
        if events is None or not config.enable_prefix_caching:
            return None
        endpoint = connect_address(events.endpoint, backend.url)
        if endpoint is None:
            logger.warning("backend %s publishes KV events in-process only (%s)", backend.url, events.endpoint)
            return None
        replay = connect_address(events.replay_endpoint, backend.url) if events.replay_endpoint else None
        return EventSource(endpoint, replay, events.topic)

    async def _stop_events(self, backend: Backend) -> None:
        if backend.subscriber is not None:
            await backend.subscriber.stop()
            backend.subscriber = None

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health.interval)
            try:
                await asyncio.gather(*(self.probe(b) for b in self.backends))
            except Exception:  # a failed round must not end the health checks
                logger.exception("health check round failed")
