"""Child processes on loopback for the live benchmarks and the tests: ``prefixcache`` commands and ``redis-server``.

A ``prefixcache`` server binds port 0 and its URL is read back from uvicorn's startup line, so parallel runs
never race for a port; its output goes to a log file whose end any failure message shows. Every process here
is a context manager that stops and reaps it however the block ends (an error, Ctrl-C).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Self

import httpx

from prefixcache.bench.serve import Target, send_request, streaming_client

if TYPE_CHECKING:
    from prefixcache.model.config import ModelConfig

_READY = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")
STOP_HANG_S = 60.0


def served_model(model: str | None) -> tuple[Path, str, ModelConfig]:
    """The model a live benchmark's servers will load: its folder, name and config, read as the servers read them;
    a model that cannot be found or read ends the benchmark with its one-line reason."""
    from prefixcache.model.loader import read_config, resolve_model

    try:
        model_dir, name = resolve_model(model)
        return model_dir, name, read_config(model_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(str(exc)) from None


def free_port() -> int:
    """A loopback port nobody listens on right now (for programs that cannot bind port 0 and report it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    """A ``prefixcache`` subcommand (``args`` start with its name) on a free loopback port; ``env`` on top of ours."""

    def __init__(self, args: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self.url = ""
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "prefixcache.cli", *args, "--host", "127.0.0.1", "--port", "0"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready_url(self, log: str) -> str | None:
        """The URL it serves on, once its log says so (uvicorn's startup line)."""
        match = _READY.search(log)
        return match.group(1) if match else None

    def wait_ready(self, timeout: float) -> None:
        """Block until /health answers 200; SystemExit with the end of the log if it exits or takes too long."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            log = self.log()
            if self.process.poll() is not None:
                raise SystemExit(f"{self.log_path.name} exited with {self.process.returncode}:\n{log[-3000:]}")
            url = self.ready_url(log)
            if url:
                self.url = url
                with contextlib.suppress(httpx.TransportError, ValueError):
                    if self.serving():
                        return
            time.sleep(0.1)
        raise SystemExit(f"{self.log_path.name} not ready after {timeout:.0f}s:\n{self.log()[-3000:]}")

    def serving(self) -> bool:
        """Whether it takes requests now (``/health`` answers 200)."""
        return httpx.get(f"{self.url}/health", timeout=2).status_code == 200

    def stop(self) -> None:
        """Terminate (the server shuts down its engine core and flushes its tiers), kill if that hangs; reap.

        A tiny server with a disk tier takes about 6 s to stop on two cores under a load average of 12:
        killing it sooner would lose its last tier writes and fail the run after it, so only a hang is killed.
        """
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(timeout=STOP_HANG_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=15)


class ExternalProcess(Process):
    """Another program (a vLLM server, a peer router) on a port picked for it: it cannot report a port 0.
    ``workers``: a router that registers its backends after it starts answering (sglang-router) is ready once
    its ``/workers`` lists that many healthy ones."""

    def __init__(
        self,
        command: Sequence[str],
        port: int,
        log_path: Path,
        env: dict[str, str] | None = None,
        workers: int | None = None,
    ) -> None:
        self.log_path = log_path
        self.workers = workers
        self.url = f"http://127.0.0.1:{port}"
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                list(command),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
            )

    def ready_url(self, log: str) -> str | None:
        return self.url

    def serving(self) -> bool:
        if not super().serving():
            return False
        if self.workers is None:
            return True
        listed = httpx.get(f"{self.url}/workers", timeout=2).json()
        workers = listed.get("workers", []) if isinstance(listed, dict) else listed
        return sum(1 for w in workers if isinstance(w, dict) and w.get("is_healthy")) >= self.workers


@contextlib.contextmanager
def running(processes: Sequence[Process], timeout: float) -> Iterator[Sequence[Process]]:
    """Wait for all of them; stop all of them however the block ends."""
    try:
        for process in processes:
            process.wait_ready(timeout)
        yield processes
    finally:
        for process in processes:
            process.stop()


def scrape(url: str, label: str) -> dict[tuple[str, str], float]:
    """A server's metrics as {(sample name, value of ``label``): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (sample.name, sample.labels.get(label, "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def warm_up(servers: Sequence[Process], model: str, vocab_size: int, prompt_len: int) -> None:
    """One request per server, the same prompt for all, so first-call costs land outside the measurements."""
    prompt = random.Random(0).choices(range(2, vocab_size), k=prompt_len)
    async with streaming_client(600) as client:
        for server in servers:
            result = await send_request(client, Target(server.url, model, {}), prompt, 2)
            if not result.success:
                raise SystemExit(f"warm-up on {server.url} failed: {result.error}")


class RedisServer:
    """One ``redis-server`` on a free loopback port, keeping nothing on disk; ``stop`` kills it (as a crash
    would) and ``start`` brings it back on the same port. FileNotFoundError where redis-server is not installed."""

    def __init__(self, directory: Path, extra_args: Sequence[str] = (), password: str | None = None) -> None:
        """``extra_args`` are more ``redis-server`` options (an ACL ``--user``, a ``--tls-port``...); with
        ``password`` it is started with ``--requirepass`` and the readiness check authenticates."""
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError("redis-server not found on PATH")
        self.directory = directory
        self.extra_args = [*extra_args, *(["--requirepass", password] if password is not None else [])]
        self.password = password
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start and wait until it answers PING; on a port taken meanwhile, move to another free one."""
        for _ in range(5):
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--dir",
                    str(self.directory),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--protected-mode",
                    "no",
                    *self.extra_args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._wait_ready():
                return
            self.stop()
            self.port = free_port()
        raise RuntimeError("redis-server did not start")

    def _wait_ready(self, timeout: float = 20.0) -> bool:
        import redis

        client = redis.Redis(port=self.port, password=self.password, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.ConnectionError:
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def stop(self) -> None:
        """Kill the server (SIGKILL: no goodbye to clients) and reap it; its data is gone (nothing is saved)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.process is not None:
            self.process.wait(timeout=10)
        self.process = None
