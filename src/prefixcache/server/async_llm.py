"""The server's engine: input and output processing here, the engine core in its own process.

Tokenizing and chat templates run on a worker thread (never on the event loop, never in the core);
outputs arrive as batches from the core and are detokenized here, then handed to each request's
``RequestStream``. If the core process dies, every in-flight request ends at once with an
``EngineDeadError``, new requests are refused, and ``on_dead`` tells the server to exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import msgspec

from prefixcache.config import EngineConfig
from prefixcache.core import PrefixLookup
from prefixcache.core.retention import RetentionRange
from prefixcache.engine.chat_breakpoints import Breakpoint
from prefixcache.engine.core_process import EngineCoreProcess
from prefixcache.engine.input_processor import DEFAULT_PROMPT_OPTIONS, InputProcessor, PromptInput, PromptOptions
from prefixcache.engine.messages import (
    AbortRequests,
    EngineCoreFailure,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    EngineStats,
    UtilityCall,
    UtilityResult,
)
from prefixcache.engine.output_processor import OutputProcessor
from prefixcache.engine.outputs import RequestOutput
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

EXIT_DRAIN_S = 0.2


class EngineDeadError(RuntimeError):
    """The engine cannot complete the request: its core process is gone, or the server is shutting down."""


class RequestStream:
    """One API request's outputs, as ``(choice index, RequestOutput)`` in arrival order until every choice ended.

    A request with several prompts or ``n`` > 1 runs as one core request per choice, ``<id>-<index>``.
    ``abort()`` stops the choices still running; it is idempotent and a no-op once all finished.
    """

    def __init__(self, engine: AsyncLLM, request_id: str, core_ids: list[str]) -> None:
        self.request_id = request_id
        self.indices = {core_id: index for index, core_id in enumerate(core_ids)}
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self._last_token_times: dict[str, float] = {}
        self._unfinished = set(core_ids)
        self._engine = engine
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self.indices)
        while remaining:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            remaining -= item[1].finished

    def abort(self) -> None:
        """Stop generating and free the blocks of every choice still running (client gone, handler failed)."""
        for core_id in list(self._unfinished):
            self._unfinished.discard(core_id)
            self._engine._abort(core_id, self.arrival_time)

    def _put(self, item: tuple[int, RequestOutput] | BaseException) -> None:
        self._queue.put_nowait(item)


class AsyncLLM:
    """Serves many concurrent requests from one engine core process; ``start()`` inside the event loop."""

    def __init__(self, config: EngineConfig, tokenizer: Any, metrics: ServerMetrics) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.on_dead: Callable[[], None] | None = None
        self.dead = False
        self.draining = False
        self.info: EngineInfo | None = None
        self.latest_stats: EngineStats | None = None
        self._core: EngineCoreProcess | None = None
        self._input_processor: InputProcessor | None = None
        self._output_processor = OutputProcessor(tokenizer)
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._decode_token)
        self._tokenize_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixcache-tokenize")
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._reader: asyncio.Task[None] | None = None
        self._failure: str | None = None
        self._closing = False

    @property
    def is_running(self) -> bool:
        return self.info is not None and not self.dead

    @property
    def accepting(self) -> bool:
        return self.is_running and not self.draining

    @property
    def num_in_flight(self) -> int:
        """Core requests in flight (a request with n choices counts n)."""
        return len(self._streams)

    async def start(self) -> None:
        """Start the core process and wait for its handshake (raises EngineStartupError if it fails to start)."""
        self._core = EngineCoreProcess(self.config)
        try:
            self.info = await self._core.start()
        except BaseException:
            await self._core.close()
            raise
        self._input_processor = InputProcessor(self.tokenizer, self.info)
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read_outputs(), name="prefixcache-core-outputs")
        loop.add_reader(self._core.process.sentinel, self._on_core_exit)
        self.latest_stats = msgspec.convert(await self._call("stats"), EngineStats)

    async def shutdown(self) -> None:
        """Stop the core process (reaped, whatever state it is in) and release everything."""
        self._closing = True
        if self._core is not None:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self._core.process.sentinel)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._core is not None:
            await self._core.close()
        self._tokenize_executor.shutdown(wait=False, cancel_futures=True)

    async def add_request(
        self,
        prompts: Sequence[PromptInput],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        n: int = 1,
        retention: tuple[RetentionRange, ...] = (),
        tenant: str | None = None,
        options: PromptOptions = DEFAULT_PROMPT_OPTIONS,
    ) -> RequestStream:
        """Validate and queue ``n`` choices per prompt; ValueError (nothing queued) for input the engine cannot serve.

        ``retention`` (the same ranges for every prompt) and ``tenant`` go on each core request as they are.

        Choice ``p * n + i`` is the i-th sample of prompt p. The n copies of a prompt are queued together, so
        the later ones share the blocks the first one fills (prefix caching makes n > 1 nearly free); with a
        seed, copy i draws with ``seed + i`` (vLLM's rule), so the copies differ but stay reproducible.
        """
        self._check_accepting()
        if not prompts or n < 1:
            raise ValueError("a request needs at least one prompt and n >= 1")
        core_ids = [f"{request_id}-{index}" for index in range(len(prompts) * n)]
        if any(core_id in self._streams for core_id in core_ids):
            raise ValueError(f"a request with id {request_id!r} is already in flight")
        processed = await self._on_worker(
            self._process, prompts, params, core_ids, cache_salt, n, retention, tenant, options
        )
        self._check_accepting()  # the core may have died while the prompt was tokenized
        if any(core_id in self._streams for core_id in core_ids):  # taken while this one was tokenized
            raise ValueError(f"a request with id {request_id!r} is already in flight")
        stream = RequestStream(self, request_id, core_ids)
        try:
            for request, text in processed:
                self._streams[request.request_id] = stream
                self._output_processor.add_request(request, text)
                await self._core.send(request)
        except BaseException:
            stream.abort()
            raise
        return stream

    async def render(
        self,
        prompts: Sequence[PromptInput],
        params: SamplingParams,
        retention: tuple[RetentionRange, ...] = (),
        options: PromptOptions = DEFAULT_PROMPT_OPTIONS,
    ) -> list[list[int]]:
        """The token ids each prompt would run on (tokenized, truncated, validated exactly as ``add_request``
        does, ``retention`` included); ValueError for a request the engine would refuse. Queues nothing."""
        self._check_accepting()
        process = self._input_processor.process
        return await self._on_worker(
            lambda: [
                process(p, params, "render", retention=retention, options=options)[0].prompt_token_ids for p in prompts
            ]
        )

    async def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, add_special_tokens: bool = False
    ) -> list[int]:
        self._check_accepting()
        return await self._on_worker(
            self._input_processor.apply_chat_template, messages, add_generation_prompt, add_special_tokens
        )

    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        breakpoints: list[Breakpoint],
        add_special_tokens: bool = False,
    ) -> tuple[dict[str, Any], list[int]]:
        """The conversation as a prompt dict of token ids (with ``tools`` for the template, the tokenizer's special
        tokens on top when ``add_special_tokens``, and the message ends as checkpoint hints on a model with recurrent
        layers) and the token position of each breakpoint (``InputProcessor.chat_prompt``)."""
        self._check_accepting()
        return await self._on_worker(
            self._input_processor.chat_prompt, messages, tools, breakpoints, True, add_special_tokens
        )

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text``; the default is what the completions endpoint feeds the model."""
        return await self._on_worker(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self._on_worker(self.tokenizer.decode, token_ids)

    def _decode_token(self, token_id: int) -> str:
        """One token alone as text (for log-probabilities; a byte of a multi-byte character shows as U+FFFD)."""
        return self.tokenizer.decode([token_id])

    async def reset_prefix_cache(self) -> bool:
        return await self._call("reset_prefix_cache")

    async def lookup(
        self, prompt: PromptInput, cache_salt: str | None = None, add_special_tokens: bool = True
    ) -> tuple[list[int], PrefixLookup]:
        """The prompt's token ids (tokenized as ``add_request`` does) and what the core's cache and offload tiers
        hold of them now: the core answers between steps, runs no model and changes nothing. ValueError for a
        prompt the engine would refuse."""
        _, token_ids = await self._on_worker(
            self._input_processor.prompt_token_ids, prompt, add_special_tokens=add_special_tokens
        )
        found = await self._call("lookup", token_ids, cache_salt)
        return token_ids, msgspec.convert(found, PrefixLookup)

    async def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token decoded on its own; joined, any span reads as text (a character split across tokens
        shows as a replacement character)."""
        return await self._on_worker(lambda: [self.token_text(t) for t in token_ids])

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if some still are after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self._streams

    def fail_all(self, message: str) -> None:
        """End every in-flight request with an ``EngineDeadError`` carrying ``message``."""
        error = EngineDeadError(message)
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream._put(error)
            stream.abort()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()

    def _check_accepting(self) -> None:
        if self.dead:
            raise EngineDeadError(self._failure or "the engine core is not running")
        if self.draining:
            raise EngineDeadError("the server is shutting down and takes no new requests")

    async def _on_worker(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_executor, lambda: fn(*args, **kwargs))

    def _process(
        self,
        prompts: Sequence[PromptInput],
        params: SamplingParams,
        core_ids: list[str],
        cache_salt: str | None,
        n: int,
        retention: tuple[RetentionRange, ...],
        tenant: str | None,
        options: PromptOptions,
    ) -> list[tuple[EngineCoreRequest, str | None]]:
        """Every choice's core request (each prompt tokenized and validated once); runs on the worker thread."""
        processed = []
        for p, prompt in enumerate(prompts):
            request, text = self._input_processor.process(
                prompt, params, core_ids[p * n], cache_salt, retention=retention, tenant=tenant, options=options
            )
            processed.append((request, text))
            for i in range(1, n):
                child_params = params if params.seed is None else replace(params, seed=(params.seed + i) % 2**64)
                child = msgspec.structs.replace(request, request_id=core_ids[p * n + i], sampling_params=child_params)
                processed.append((child, text))
        return processed

    async def _call(self, method: str, *args: Any) -> Any:
        if self.dead:
            raise EngineDeadError(self._failure or "the engine core is not running")
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        await self._core.send(UtilityCall(call_id, method, list(args)))
        return await future

    def _abort(self, request_id: str, arrival_time: float) -> None:
        """Forget the core request here now (counted as finished by ``abort``); the core frees its blocks when
        the abort message arrives."""
        self._streams.pop(request_id, None)
        if self._output_processor.abort_request(request_id):
            self.metrics.observe_finished("abort", time.monotonic() - arrival_time)
            if not self.dead and not self._closing:
                self._send_soon(AbortRequests([request_id]))

    def _send_soon(self, message: AbortRequests) -> None:
        task = asyncio.get_running_loop().create_task(self._core.send(message))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _read_outputs(self) -> None:
        while True:
            message = await self._core.recv()
            if isinstance(message, EngineCoreOutputs):
                self._dispatch(message)
            elif isinstance(message, UtilityResult):
                self._resolve(message)
            elif isinstance(message, EngineCoreFailure):
                self._failure = message.message
                logger.error("%s", message.message)

    def _resolve(self, result: UtilityResult) -> None:
        future = self._calls.pop(result.call_id, None)
        if future is None or future.done():
            return
        if result.error is not None:
            future.set_exception(RuntimeError(result.error))
        else:
            future.set_result(result.result)

    def _dispatch(self, batch: EngineCoreOutputs) -> None:
        now = time.monotonic()
        outputs, stopped = self._output_processor.process_outputs(batch.outputs)
        if stopped:
            self._send_soon(AbortRequests(stopped))
        for output in outputs:
            core_id = output.request_id
            stream = self._streams.get(core_id)
            if stream is None:
                continue
            num_new = len(output.new_token_ids)
            last = stream._last_token_times.get(core_id)
            if num_new:
                if last is None:
                    self.metrics.observe_first_token(now - stream.arrival_time, len(output.prompt_token_ids), num_new)
                    stream.first_token_time = stream.first_token_time or now
                else:
                    self.metrics.observe_next_token(now - last, num_new)
                stream._last_token_times[core_id] = now
            if output.finished:
                stream._unfinished.discard(core_id)
                del self._streams[core_id]
                self.metrics.observe_finished(output.outputs[0].finish_reason, now - stream.arrival_time)
            stream._put((stream.indices[core_id], output))
        self.latest_stats = batch.stats
        self.metrics.update(batch.stats)

    def _on_core_exit(self) -> None:
        """The core process ended. Unless we asked it to, fail everything and tell the server to exit."""
        asyncio.get_running_loop().remove_reader(self._core.process.sentinel)
        if not self._closing:
            self.dead = True  # refuse new requests from now on
            asyncio.get_running_loop().create_task(self._fail_after_core_exit())

    async def _fail_after_core_exit(self) -> None:
        # Its last messages (outputs, or the failure that says why) may still be queued: let the reader
        # take them first, so finished requests complete and the error names the cause.
        await asyncio.sleep(EXIT_DRAIN_S)
        self._core.process.join(timeout=1.0)
        exit_code = self._core.process.exitcode
        reason = self._failure or f"the engine core process exited unexpectedly (exit code {exit_code})"
        self._failure = reason
        logger.error("%s; failing %d in-flight requests", reason, len(self._streams))
        self.fail_all(reason)
        if self.on_dead is not None:
            self.on_dead()
