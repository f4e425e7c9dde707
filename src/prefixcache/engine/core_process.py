"""The engine core in its own process, and the API side's handle on it.

The API process binds two ZeroMQ sockets on IPC paths in a private temporary directory: requests,
aborts and utility calls go out on a PUSH socket, output batches come back on a PULL socket. The child
(started with ``spawn``, so it shares no state with the server) loads the model, answers with an
``EngineInfo`` handshake and then loops: drain its input, step while there is work, send each step's
outputs. Nothing in the API process can stall that loop, and sending never preempts it (its ZeroMQ I/O
thread runs as ``SCHED_BATCH``).

The child never outlives the server: it asks the kernel for SIGKILL when its parent dies
(``PR_SET_PDEATHSIG``), also checks its parent between steps, and ignores SIGINT (a terminal's Ctrl-C
reaches the whole process group; the server decides how to shut the core down). A step that raises
sends ``EngineCoreFailure`` and exits non-zero: after a failed forward pass the cache may index blocks
whose K/V was never written, so the core must not go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
from typing import Any

import zmq
import zmq.asyncio

from prefixcache.config import EngineConfig
from prefixcache.engine.messages import (
    AbortRequests,
    CoreInput,
    CoreOutput,
    EngineCoreFailure,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineInfo,
    Shutdown,
    UtilityCall,
    UtilityResult,
    encoder,
    input_decoder,
    output_decoder,
)

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # how often an idle core checks that its parent is alive
UTILITY_METHODS = frozenset({"reset_prefix_cache", "stats", "lookup"})
_PR_SET_PDEATHSIG = 1


def run_engine_core(config: EngineConfig, input_address: str, output_address: str, log_level: int) -> None:
    """The child's entry point: never returns normally; exits 0 on ``Shutdown``, 1 on a failure."""
    parent_pid = os.getppid()
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    # Where KV events are published, and who can read them, is told at start-up like the server's own address.
    logging.getLogger("prefixcache.kv_events").setLevel(min(logging.INFO, log_level))
    context = zmq.Context()
    _never_preempt_the_step(context)
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    exit_code = 0
    try:
        from prefixcache.engine.core import EngineCore

        try:
            core = EngineCore(config)
        except Exception as exc:  # the settings cannot run here: the server says why in one line and exits
            logger.debug("engine core failed to start", exc_info=True)
            outputs.send(encoder.encode(EngineCoreFailure(startup_failure(exc))))
            exit_code = 1
        else:
            try:
                outputs.send(encoder.encode(core.info()))
                _serve(core, inputs, outputs, parent_pid)
            finally:
                core.close()
    except Exception as exc:
        logger.exception("engine core failed")
        outputs.send(encoder.encode(EngineCoreFailure(f"the engine core failed: {exc!r}")))
        exit_code = 1
    finally:
        inputs.close(linger=0)
        outputs.close(linger=2000)  # let the last message (outputs or the failure) reach the server
        context.term()
    sys.exit(exit_code)


def startup_failure(exc: Exception) -> str:
    """What an engine that cannot start says: a configuration error's own words (it names the setting), else
    the error's kind too (a device torch cannot use, say); ``--log-level DEBUG`` logs the traceback."""
    if isinstance(exc, ValueError | OSError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _serve(core: Any, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int) -> None:
    """Busy loop: take every queued message, step if there is work, send the step's outputs."""
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    while True:
        changed = False
        if poller.poll(0 if core.has_unfinished_requests() else IDLE_POLL_MS):
            while True:
                try:
                    message = input_decoder.decode(inputs.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(message, Shutdown):
                    return
                reply = _handle(core, message)
                if reply is not None:
                    outputs.send(encoder.encode(reply))
                changed = True
        if os.getppid() != parent_pid:
            logger.error("the server process is gone; the engine core exits")
            return
        if core.has_unfinished_requests():
            outputs.send(encoder.encode(core.step()))
        elif changed:  # an abort or reset changed the stats the server shows: send them without a step
            outputs.send(encoder.encode(core.outputs([])))


def _handle(core: Any, message: CoreInput) -> CoreOutput | None:
    if isinstance(message, EngineCoreRequest):
        try:
            core.add_request(message)
        except ValueError as exc:  # the input processor should have caught it: end the request, not the core
            logger.error("rejected request %s: %s", message.request_id, exc)
            rejected = EngineCoreOutput(message.request_id, [], 0, finish_reason="abort", error=str(exc))
            return core.outputs([rejected])
    elif isinstance(message, AbortRequests):
        core.abort_requests(message.request_ids)
    elif isinstance(message, UtilityCall):
        if message.method not in UTILITY_METHODS:
            return UtilityResult(message.call_id, error=f"unknown engine core method {message.method!r}")
        try:
            return UtilityResult(message.call_id, result=getattr(core, message.method)(*message.args))
        except (TypeError, ValueError) as exc:  # bad arguments from the caller: answer, do not end the core
            return UtilityResult(message.call_id, error=f"{message.method}: {exc}")
    return None


def _never_preempt_the_step(context: zmq.Context) -> None:
    """Run the context's I/O thread as ``SCHED_BATCH``, so that waking it to send a step's outputs never
    preempts the step loop on its core.

    Each ``send`` wakes ZeroMQ's I/O thread. A normal thread woken on the CPU the loop runs on preempts it, and on
    a busy machine the loop then waits for its turn again: measured at 3.5-4.9 ms a token (of 50-65) in ``send``
    on the shared 2-core host, against 0.2 ms with the thread as ``SCHED_BATCH``, which the kernel never lets
    preempt on wake-up (it runs at once where a CPU is idle, else at the loop's next switch; its share is
    unchanged). Linux only. libzmq aborts the process when the policy is refused, so a throwaway thread tries it
    first; where it is refused (a sandbox), the default stays."""
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is None or not sys.platform.startswith("linux"):
        return
    allowed: list[bool] = []

    def try_batch() -> None:  # sched_setscheduler(0, ...) applies to the calling thread only
        try:
            os.sched_setscheduler(0, batch, os.sched_param(0))
        except OSError:
            allowed.append(False)
        else:
            allowed.append(True)

    probe = threading.Thread(target=try_batch, name="prefixcache-sched-probe")
    probe.start()
    probe.join()
    if allowed == [True]:
        with contextlib.suppress(zmq.ZMQError):
            context.set(zmq.THREAD_SCHED_POLICY, batch)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies; elsewhere the parent check in the loop does."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class EngineStartupError(RuntimeError):
    """The engine core could not start (its settings cannot run here, or it died while loading)."""


class EngineCoreProcess:
    """The API side of a running engine core process: its sockets, its process, its handshake."""

    def __init__(self, config: EngineConfig) -> None:
        self._dir = tempfile.mkdtemp(prefix="prefixcache-core-")
        self._context = zmq.asyncio.Context()
        self._inputs = self._context.socket(zmq.PUSH)
        self._outputs = self._context.socket(zmq.PULL)
        input_address, output_address = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._inputs.bind(input_address)
        self._outputs.bind(output_address)
        log_level = logging.getLogger().getEffectiveLevel()
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            args=(config, input_address, output_address, log_level),
            name="prefixcache-engine-core",
        )
        self.info: EngineInfo | None = None

    async def start(self) -> EngineInfo:
        """Start the child and wait for its handshake; raises EngineStartupError if it fails or exits first."""
        self.process.start()
        while not await self._outputs.poll(100):
            if not self.process.is_alive():
                raise EngineStartupError(f"the engine core exited during startup (exit code {self.process.exitcode})")
        message = await self.recv()
        if isinstance(message, EngineCoreFailure):
            raise EngineStartupError(message.message)
        if not isinstance(message, EngineInfo):
            raise EngineStartupError(f"unexpected first message from the engine core: {type(message).__name__}")
        self.info = message
        return message

    async def send(self, message: CoreInput) -> None:
        await self._inputs.send(encoder.encode(message))

    async def recv(self) -> CoreOutput:
        return output_decoder.decode(await self._outputs.recv())

    async def close(self, timeout: float = 10.0) -> None:
        """Ask the core to exit after its current step; terminate, then kill it if it does not. Always reaps."""
        if self.process.is_alive():
            # a core that is exiting takes no message: the send times out, and terminate follows
            with contextlib.suppress(zmq.ZMQError, TimeoutError):
                await asyncio.wait_for(self.send(Shutdown()), 1.0)
            for stop in (None, self.process.terminate, self.process.kill):
                if stop is not None:
                    stop()
                if await self._wait_exit(timeout if stop is None else 5.0):
                    break
        if self.process.pid is not None:
            self.process.join(timeout=5.0)
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _wait_exit(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.process.is_alive():
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True
