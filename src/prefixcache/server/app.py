"""The FastAPI app: OpenAI's completions and chat endpoints, Anthropic's Messages API, vLLM's
tokenize/detokenize, models, version, health, metrics, cache lookup and reset (one module each under
``server/routes/``).

The engine and the settings live on ``app.state``; handlers read them from there (``routes/state.py``).
Every error, whatever raised it (pydantic, the engine, a bad route, auth, the body cap), leaves as OpenAI's
``{"error": {"message", "type", "param", "code"}}`` (on ``/v1/messages``, Anthropic's shape): a 4xx for bad
input, a 500 only for our own bugs (logged with the traceback), and the server keeps serving. A request whose
client goes away is aborted, so its KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from prefixcache.http.anthropic import AnthropicErrorMiddleware
from prefixcache.http.middleware import APIKeyMiddleware, BodyLimitMiddleware, RequestContextMiddleware
from prefixcache.server.async_llm import AsyncLLM
from prefixcache.server.errors import install_error_handlers
from prefixcache.server.routes import cache, generation, info, messages, tokens
from prefixcache.server.settings import ServerSettings
from prefixcache.server.startup import startup_lines

logger = logging.getLogger(__name__)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Writes the start-up summary and starts the periodic stats line with the app; stops the engine after.
    The engine is started before (``DrainingServer``), so an engine that cannot start is one line, not an
    application startup traceback."""
    engine: AsyncLLM = app.state.engine
    interval = app.state.settings.log_stats_interval
    for line in startup_lines(engine.info, engine.config, engine.latest_stats):
        logger.info("%s", line)
    log_task = asyncio.create_task(_log_stats_every(engine, interval)) if interval else None
    try:
        yield
    finally:
        if log_task is not None:
            log_task.cancel()
        await engine.shutdown()


def build_app(engine: AsyncLLM, settings: ServerSettings) -> FastAPI:
    """The app around an engine started before its lifespan runs; the lifespan stops it."""
    app = FastAPI(title="prefixcache", lifespan=_lifespan)
    app.state.engine = engine
    app.state.settings = settings
    app.state.started = int(time.time())
    # Added innermost first: the request context wraps everything, auth runs before the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.api_keys or settings.metrics_api_key:
        app.add_middleware(
            APIKeyMiddleware,
            api_keys=settings.api_keys,
            share_cache=settings.share_cache_across_keys,
            metrics_key=settings.metrics_api_key,
        )
    app.add_middleware(RequestContextMiddleware, log_requests=settings.log_requests)
    app.add_middleware(AnthropicErrorMiddleware)  # outermost: rewrites whatever error the others wrote
    install_error_handlers(app)
    for module in (generation, messages, tokens, cache, info):
        app.include_router(module.router)
    if settings.enable_reset_prefix_cache:
        app.include_router(cache.reset_router)
    return app


async def _log_stats_every(engine: AsyncLLM, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        if engine.latest_stats is not None:
            engine.metrics.log_stats(engine.latest_stats, time.monotonic())
