"""Drives the synchronous engine from asyncio: one loop steps it for every in-flight request.

``LLMEngine`` is not thread-safe, so everything that touches it (add, abort, step, stats, the chat
template's tokenizer) runs on one dedicated worker thread, in submission order. The event loop only
awaits those calls, so it keeps serving HTTP while a batch runs; each request's outputs reach its
handler through an asyncio queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from prefixcache.core import PrefixLookup
from prefixcache.engine import EngineStats, LLMEngine, RequestOutput, SamplingParams
from prefixcache.engine.llm_engine import PromptInput
from prefixcache.engine.prompts import token_texts
from prefixcache.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine failed while running a request; the request cannot complete."""


class RequestStream:
    """One request's outputs in order. ``abort()`` is idempotent and a no-op once the request finished."""

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self.last_token_time: float | None = None
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    def abort(self) -> None:
        """Stop generating and free the request's blocks (the client went away or the handler failed)."""
        if not self.finished:
            self.finished = True
            self._engine._abort(self.request_id)

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)


class AsyncEngine:
    """Serves many concurrent requests from one engine; ``start()`` inside the server's event loop."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixcache-engine")
        self._streams: dict[str, RequestStream] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="prefixcache-engine-loop")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def add_request(
        self, prompt: PromptInput, params: SamplingParams, request_id: str, cache_salt: str | None = None
    ) -> RequestStream:
        """Queue a request; raises ValueError (nothing queued) for input the engine cannot serve."""
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        try:
            await self._call(self.engine.add_request, prompt, params, request_id, cache_salt)
        except BaseException:
            stream.abort()  # also covers a handler cancelled while the worker was still adding it
            raise
        self._wakeup.set()
        return stream

    async def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        return await self._call(self.engine.apply_chat_template, messages)

    async def stats(self) -> EngineStats:
        return await self._call(self.engine.stats)

    async def reset_prefix_cache(self) -> bool:
        return await self._call(self.engine.reset_prefix_cache)

    async def lookup(self, prompt: PromptInput, cache_salt: str | None = None) -> PrefixLookup:
        return await self._call(self.engine.lookup, prompt, cache_salt)

    async def token_texts(self, token_ids: list[int]) -> list[str]:
        return await self._call(token_texts, self.engine.tokenizer, token_ids)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _abort(self, request_id: str) -> None:
        """Forget the stream now; the engine frees the blocks on the worker, after anything queued before."""
        self._streams.pop(request_id, None)
        with contextlib.suppress(RuntimeError):  # the executor is shut down: the engine and its blocks are gone
            self._executor.submit(self.engine.abort_request, request_id)

    async def _run(self) -> None:
        """Step while there is work, else sleep until a request arrives.

        The wake-up flag is cleared before each step, so a request added during the step (or before
        it, on the worker) is either seen by that step or sets the flag again: none is left waiting.
        """
        while True:
            self._wakeup.clear()
            try:
                results, busy = await self._call(self._step)
            except Exception as exc:
                logger.exception("engine step failed; failing every in-flight request")
                self._fail_all(exc)
                continue
            self._dispatch(results)
            if not busy:
                await self._wakeup.wait()

    def _step(self) -> tuple[list[tuple[RequestOutput, float, float]], bool]:
        """On the worker: one batch, with each output's arrival and token time (read before it is freed)."""
        in_flight = dict(self.engine.requests)
        results = []
        for output in self.engine.step():
            request = in_flight[output.request_id]
            results.append((output, request.arrival_time, request.last_token_time))
        return results, self.engine.has_unfinished_requests()

    def _dispatch(self, results: list[tuple[RequestOutput, float, float]]) -> None:
        for output, arrival_time, token_time in results:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted while the step ran
                continue
            num_new = len(output.new_token_ids)
            if stream.last_token_time is None:
                self.metrics.observe_first_token(token_time - arrival_time, len(output.prompt_token_ids), num_new)
            else:
                self.metrics.observe_next_token(token_time - stream.last_token_time, num_new)
            stream.last_token_time = token_time
            if output.finished:
                stream.finished = True
                del self._streams[output.request_id]
                self.metrics.observe_finished(output.outputs[0].finish_reason, token_time - arrival_time)
            stream._put(output)

    def _fail_all(self, exc: Exception) -> None:
        error = EngineDeadError(f"the engine failed: {exc}")
        for stream in list(self._streams.values()):
            stream._put(error)
            stream.abort()
