"""The router's settings and its FastAPI app: the parts built once (index, metrics, backends, policy, proxy),
the middleware, and the endpoints of ``router/routes.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI

from prefixcache.http.anthropic import AnthropicErrorMiddleware
from prefixcache.http.auth import valid_api_key
from prefixcache.http.flags import DEFAULT_MAX_REQUEST_BYTES
from prefixcache.http.middleware import BodyLimitMiddleware, RequestContextMiddleware
from prefixcache.router import routes
from prefixcache.router.backends import BackendPool, HealthSettings
from prefixcache.router.index import PrefixIndex
from prefixcache.router.metrics import RouterMetrics
from prefixcache.router.policy import DEFAULT_AFFINITY_BALANCE, DEFAULT_PREFIX_WEIGHT, POLICIES, make_policy
from prefixcache.router.proxy import Proxy
from prefixcache.router.routing import Router
from prefixcache.router.subscriber import EventSource
from prefixcache.router.wire import DEFAULT_CONTENT_BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """``request_timeout`` bounds each read from a backend (None: wait as long as generation takes).
    ``backend_api_key`` authenticates the router's own calls to the backends; it is kept out of the repr.
    ``event_sources`` names where backends without ``/v1/cache/config`` publish KV events (backend URL ->
    source), whose blocks must hold ``kv_event_block_size`` tokens.
    ``max_request_bytes`` caps a request body as the server's ``--max-request-bytes`` does (413 before parsing)."""

    backends: tuple[str, ...]
    policy: str = "prefix"
    prefix_weight: float = DEFAULT_PREFIX_WEIGHT
    health: HealthSettings = field(default_factory=HealthSettings)
    request_timeout: float | None = None
    backend_api_key: str | None = field(default=None, repr=False)
    event_sources: tuple[tuple[str, EventSource], ...] = ()
    kv_event_block_size: int = DEFAULT_CONTENT_BLOCK_SIZE
    affinity_balance: float = DEFAULT_AFFINITY_BALANCE
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("the router needs at least one --backend")
        for url in self.backends:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"a backend is an http(s) URL such as http://10.0.0.2:8000, got {url!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.prefix_weight < 0:
            raise ValueError(f"the prefix weight must be >= 0, got {self.prefix_weight}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError("the request timeout must be positive")
        if self.backend_api_key is not None and not valid_api_key(self.backend_api_key):
            raise ValueError("the backend API key must be non-empty printable ASCII without spaces")
        backends = {url.rstrip("/") for url in self.backends}
        for url, _ in self.event_sources:
            if url.rstrip("/") not in backends:
                raise ValueError(f"--kv-event-source names {url}, which is not one of the --backend URLs")
        if self.kv_event_block_size <= 0:
            raise ValueError(f"the KV event block size must be positive, got {self.kv_event_block_size}")
        if self.affinity_balance != 0 and not self.affinity_balance >= 1:
            raise ValueError(f"the affinity balance must be >= 1 (or 0: off), got {self.affinity_balance}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {self.max_request_bytes}")


def build_app(settings: RouterSettings, tokenizer: Any) -> FastAPI:
    """The app; its lifespan probes the backends (raising BackendRefusedError on a hashing mismatch).

    The server's own middleware bounds what one client can make it do: a body over ``max_request_bytes`` is
    refused before it is parsed, every request gets an id (the backend sees it too), and an unexpected
    failure is an OpenAI-shaped 500, never a bare one (Anthropic-shaped on ``/v1/messages``, as every error
    there). Per-request log lines are uvicorn's access log.
    """
    index = PrefixIndex()
    metrics = RouterMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(settings.request_timeout, connect=settings.health.timeout)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            pool = BackendPool(
                list(settings.backends),
                index,
                metrics,
                client,
                settings.health,
                settings.backend_api_key,
                dict(settings.event_sources),
                settings.kv_event_block_size,
            )
            policy = make_policy(settings.policy, settings.prefix_weight, settings.affinity_balance)
            router = Router(pool, index, policy, tokenizer)
            await pool.start()
            app.state.pool, app.state.router = pool, router
            app.state.proxy = Proxy(router, pool, client, metrics)
            try:
                yield
            finally:
                await pool.stop()
                router.close()

    app = FastAPI(title="prefixcache router", lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)  # innermost first
    app.add_middleware(RequestContextMiddleware, log_requests=False)
    app.add_middleware(AnthropicErrorMiddleware)  # outermost: every error on /v1/messages in Anthropic's shape
    app.state.index = index
    app.state.metrics = metrics
    app.include_router(routes.router)
    return app
