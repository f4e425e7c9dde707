"""Graceful shutdown: uvicorn's server with a drain on the first SIGTERM/SIGINT.

First signal: refuse new requests (503, and /health 503 so a balancer stops sending), let in-flight
requests finish for up to ``shutdown_timeout`` seconds, end the rest with an error, then stop; the app's
lifespan then reaps the engine core. A second signal stops at once. Unlike plain uvicorn, the signal is
not re-raised after the shutdown, so a drained server exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import uvicorn

from prefixcache.engine.core_process import EngineStartupError
from prefixcache.server.async_llm import AsyncLLM

logger = logging.getLogger(__name__)
uvicorn_logger = logging.getLogger("uvicorn.error")

DEAD_EXIT_DELAY_S = 2.0


class DrainingServer(uvicorn.Server):
    def __init__(self, app: Any, engine: AsyncLLM, shutdown_timeout: float, **config: Any) -> None:
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=5, **config))
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self.startup_error: str | None = None

    async def serve(self, sockets: Any = None) -> None:
        """Start the engine, then serve; an engine that cannot start leaves ``startup_error`` saying why and
        serves nothing (uvicorn would print the failure as two tracebacks and exit 3)."""
        self._loop = asyncio.get_running_loop()
        try:
            await self.engine.start()
        except EngineStartupError as exc:
            self.startup_error = str(exc)
            return
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn names the address it listens on only when it bound the socket itself; ``serve`` binds before
        the model loads (a port in use fails fast), so the same line is written here for it."""
        await super().startup(sockets)
        if sockets and self.started:
            host, port = sockets[0].getsockname()[:2]
            address = f"[{host}]" if ":" in host else host
            uvicorn_logger.info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)", address, port)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """Runs as the signal handler, so it only schedules the drain on the event loop."""
        if self._loop is None or not self.started or self.engine.draining:
            self.force_exit = self.engine.draining
            self.should_exit = True
            return
        self.engine.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def exit_soon(self) -> None:
        """The engine core died: nothing in flight can finish. Keep answering 503 (so health checks see the
        failure) for ``DEAD_EXIT_DELAY_S``, then stop; ``serve`` exits non-zero for a supervisor to restart it."""
        asyncio.get_running_loop().call_later(DEAD_EXIT_DELAY_S, setattr, self, "should_exit", True)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        logger.info(
            "shutting down: no new requests; waiting up to %.0f s for %d in flight",
            self.shutdown_timeout,
            self.engine.num_in_flight,
        )
        if not await self.engine.wait_idle(self.shutdown_timeout):
            logger.warning("shutdown timeout: ending %d requests with an error", self.engine.num_in_flight)
            self.engine.fail_all("the server shut down before the request finished")
        self.should_exit = True
