"""The server and its engine core process: start, stop, drain on SIGTERM, and a core killed under load.

Each test starts its own server (the shared ones in conftest must survive), streams from it on loopback
and checks that no process is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil
import pytest

from tests.server.harness import ServerProcess, random_prompt

ARGS = ["--block-size", "4", "--num-blocks", "1024", "--max-model-len", "1024", "--disable-uvicorn-access-log"]


@pytest.fixture
def start_server(tiny_llama_dir, tmp_path):
    started: list[ServerProcess] = []

    def start(*extra: str) -> ServerProcess:
        server = ServerProcess(tiny_llama_dir, [*ARGS, *extra], tmp_path / f"server-{len(started)}.log")
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for server in started:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait(timeout=10)


def core_process(server: ServerProcess) -> psutil.Process:
    """The engine core: the server's child that runs the spawned multiprocessing entry point."""
    children = psutil.Process(server.process.pid).children()
    [core] = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
    return core


@dataclass
class StreamResult:
    events: list[dict] = field(default_factory=list)
    done: bool = False
    first_token: threading.Event = field(default_factory=threading.Event)
    ended_at: float | None = None
    error: BaseException | None = None


def stream_completion(url: str, seed: str, max_tokens: int, result: StreamResult) -> None:
    body = {
        "prompt": random_prompt(seed, 12),
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    result.done = True
                elif line.startswith("data: "):
                    result.events.append(json.loads(line.removeprefix("data: ")))
                    result.first_token.set()
    except httpx.HTTPError as exc:
        result.error = exc
    finally:
        result.ended_at = time.monotonic()
        result.first_token.set()


def start_streams(url: str, count: int, max_tokens: int) -> tuple[list[StreamResult], list[threading.Thread]]:
    results = [StreamResult() for _ in range(count)]
    threads = [
        threading.Thread(target=stream_completion, args=(url, f"life-{i}-{time.time()}", max_tokens, r))
        for i, r in enumerate(results)
    ]
    for thread in threads:
        thread.start()
    for result in results:
        assert result.first_token.wait(30), "no first token"
    return results, threads


def wait_exit(server: ServerProcess, timeout: float) -> int:
    return server.process.wait(timeout=timeout)


def assert_no_process_left(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes left behind: {alive}"


def family(server: ServerProcess) -> list[int]:
    return [server.process.pid, *(c.pid for c in psutil.Process(server.process.pid).children(recursive=True))]


def test_start_and_stop_leave_no_process(start_server):
    server = start_server()
    pids = family(server)
    assert core_process(server).pid in pids
    server.process.send_signal(signal.SIGTERM)
    assert wait_exit(server, 30) == 0, server.log()
    assert_no_process_left(pids)


def test_killed_core_fails_every_stream_promptly_and_the_server_exits_non_zero(start_server):
    server = start_server()
    pids = family(server)
    results, threads = start_streams(server.url, 3, max_tokens=1000)
    killed_at = time.monotonic()
    os.kill(core_process(server).pid, signal.SIGKILL)
    for thread in threads:
        thread.join(30)
    for result in results:
        assert result.error is None and result.done, "a stream did not end with an error event and [DONE]"
        assert "error" in result.events[-1], result.events[-1]
        assert "exit code -9" in result.events[-1]["error"]["message"]
        assert result.ended_at - killed_at < 10
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=5)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
    assert wait_exit(server, 30) == 1
    assert_no_process_left(pids)


def test_sigterm_lets_streams_finish_refuses_new_work_and_exits_zero(start_server):
    server = start_server()
    pids = family(server)
    results, threads = start_streams(server.url, 2, max_tokens=400)
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=5)
    assert refused.status_code == 503
    assert "shutting down" in refused.json()["error"]["message"]
    for thread in threads:
        thread.join(60)
    for result in results:
        assert result.done and result.events[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0]["text"]) > 0 for e in result.events) > 0
    assert wait_exit(server, 30) == 0, server.log()
    assert_no_process_left(pids)


def test_sigterm_ends_streams_that_outlast_the_shutdown_timeout_with_an_error(start_server):
    server = start_server("--shutdown-timeout", "0.5")
    pids = family(server)
    results, threads = start_streams(server.url, 2, max_tokens=1000)
    server.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(30)
    for result in results:
        assert result.done and "shut down" in result.events[-1]["error"]["message"]
    assert wait_exit(server, 30) == 0, server.log()
    assert_no_process_left(pids)


def test_a_core_that_fails_to_start_makes_serve_exit_non_zero_with_the_reason(tiny_llama_dir, tmp_path):
    server = ServerProcess(tiny_llama_dir, ["--kv-cache-memory", "1KiB"], tmp_path / "server.log")
    assert wait_exit(server, 90) != 0  # uvicorn exits 3 when the app's startup fails
    assert "fewer than 2 blocks" in server.log()
