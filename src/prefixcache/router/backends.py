"""The backends behind the router: what each one hashes like, whether it is in the rotation, its load.

A backend enters the rotation once ``/health`` answers 200 and its ``/v1/cache/config`` hashes
like the others (the first listed backend that answers sets the reference; one that differs is
refused and re-examined at each health check). One whose config cannot be fetched (an error status, such
as 401 for a missing or wrong ``--backend-api-key``) waits out of the rotation and is asked again at each
health check. It leaves when health checks fail ``failures_to_down`` times in a
row, or at once when a request cannot reach it; leaving drops its index entries, since they may be
stale by the time it returns. The router's own calls carry its ``api_key`` as a bearer token; the requests
it forwards carry only the client's.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx
import zmq.asyncio

from prefixcache.router.backend_config import (
    CACHE_CONFIG_PATH,
    CacheConfig,
    connect_address,
    hashing_mismatch,
    parse_cache_config,
)
from prefixcache.router.index import PrefixIndex
from prefixcache.router.metrics import RouterMetrics
from prefixcache.router.subscriber import EventSource, EventSubscriber
from prefixcache.server.tenants import BEARER

logger = logging.getLogger(__name__)


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
    url: str
    up: bool = False
    refused: str | None = None
    config_error: str | None = None  # why /v1/cache/config could not be fetched the last time it was asked
    failures: int = 0
    tokens_in_flight: int = 0
    requests_in_flight: int = 0
    subscriber: EventSubscriber | None = None

    @property
    def routable(self) -> bool:
        return self.up and self.refused is None


class BackendPool:
    def __init__(
        self,
        urls: list[str],
        index: PrefixIndex,
        metrics: RouterMetrics,
        client: httpx.AsyncClient,
        health: HealthSettings = HealthSettings(),
        api_key: str | None = None,
    ) -> None:
        if not urls:
            raise ValueError("the router needs at least one backend")
        normalized = [url.rstrip("/") for url in urls]
        if len(set(normalized)) != len(normalized):
            raise ValueError("a backend URL is given twice")
        self.backends = [Backend(url) for url in normalized]
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
        if not backend.routable:
            await self._admit(backend)

    async def failed(self, backend: Backend, reason: str) -> None:
        backend.failures += 1
        if backend.up and backend.failures >= self.health.failures_to_down:
            await self.take_down(backend, reason)

    async def take_down(self, backend: Backend, reason: str) -> None:
        """Out of the rotation now; its index entries go (they may be stale when it returns)."""
        if not backend.up:
            return
        logger.warning("backend %s leaves the rotation: %s", backend.url, reason)
        backend.up = False
        await self._stop_events(backend)
        self.index.clear(backend.url)
        self.metrics.backend_up.labels(backend.url).set(0)

    async def _admit(self, backend: Backend) -> None:
        url = f"{backend.url}{CACHE_CONFIG_PATH}"
        try:
            response = await self.client.get(url, headers=self._auth, timeout=self.health.timeout)
        except httpx.HTTPError as exc:
            self._config_failed(backend, f"cannot read {CACHE_CONFIG_PATH}: {type(exc).__name__}: {exc}")
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
        backend.up = True
        self.metrics.backend_up.labels(backend.url).set(1)
        logger.info("backend %s joins the rotation (%s)", backend.url, _events_text(config))
        self._start_events(backend, config)

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

    def _start_events(self, backend: Backend, config: CacheConfig) -> None:
        events = config.kv_events
        if events is None or not config.enable_prefix_caching or self._context is None:
            return
        endpoint = connect_address(events.endpoint, backend.url)
        if endpoint is None:
            logger.warning("backend %s publishes KV events in-process only (%s)", backend.url, events.endpoint)
            return
        replay = connect_address(events.replay_endpoint, backend.url) if events.replay_endpoint else None
        source = EventSource(endpoint, replay, events.topic)
        backend.subscriber = EventSubscriber(
            backend.url, source, self.index, self.metrics, self._context, self.health.replay_timeout
        )
        backend.subscriber.start()

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


def _events_text(config: CacheConfig) -> str:
    if config.kv_events is None or not config.enable_prefix_caching:
        return "no KV events: routed by load"
    return f"KV events from {config.kv_events.endpoint}"
