"""The server and its engine core process: start, stop, drain on SIGTERM (streams and non-streaming requests
in flight finish, or end with an error after --shutdown-timeout), and a core killed under load.

Each test starts its own server (the shared ones in conftest must survive), streams from it on loopback
and checks that no process is left behind.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.helpers import scrape, wait_until
from tests.server.harness import ServerProcess, random_prompt, start_streams

ARGS = ["--block-size", "4", "--num-blocks", "1024", "--max-model-len", "1024", "--disable-uvicorn-access-log"]
DRAIN_HANG_S = 300  # bounds a hang only: draining waits for the requests in flight to end


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
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 503
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
    assert wait_exit(server, 30) == 1
    assert_no_process_left(pids)


def start_whole(url: str, max_tokens: int) -> tuple[list[httpx.Response], threading.Thread]:
    """A non-streaming completion in a thread; returns once the server runs it (its response lands in the list)."""
    responses: list[httpx.Response] = []
    body = {"prompt": random_prompt(f"whole-{time.time()}", 12), "max_tokens": max_tokens, "ignore_eos": True}
    thread = threading.Thread(
        target=lambda: responses.append(httpx.post(f"{url}/v1/completions", json=body, timeout=DRAIN_HANG_S))
    )
    running = scrape(url)["prefixcache:num_requests_running"]
    thread.start()
    deadline = time.monotonic() + 30
    while scrape(url)["prefixcache:num_requests_running"] <= running:
        assert time.monotonic() < deadline, "the non-streaming request never started running"
        time.sleep(0.02)
    return responses, thread


def test_sigterm_lets_streams_finish_refuses_new_work_and_exits_zero(start_server):
    # The drain must outlast what is in flight however slow the machine: these 1200 tokens took longer than
    # the default 30 s (and the whole response longer than 60 s) under a load average of 12. The timeout
    # expiring is the next test's.
    server = start_server("--shutdown-timeout", str(DRAIN_HANG_S))
    pids = family(server)
    results, threads = start_streams(server.url, 2, max_tokens=400)
    whole, whole_thread = start_whole(server.url, max_tokens=400)
    server.process.send_signal(signal.SIGTERM)
    # the drain starts when the signal is handled: wait for that, not for a guessed fraction of a second
    wait_until(lambda: httpx.get(f"{server.url}/health", timeout=30).status_code == 503, what="the drain to start")
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert refused.status_code == 503
    assert "shutting down" in refused.json()["error"]["message"]
    for thread in [*threads, whole_thread]:
        thread.join(DRAIN_HANG_S)
    for result in results:
        assert result.done and "error" not in result.events[-1], result.events[-1]
        assert result.events[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0]["text"]) > 0 for e in result.events) > 0
    [response] = whole
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 400
    assert wait_exit(server, DRAIN_HANG_S) == 0, server.log()
    assert_no_process_left(pids)


def test_sigterm_ends_streams_that_outlast_the_shutdown_timeout_with_an_error(start_server):
    server = start_server("--shutdown-timeout", "0.5")
    pids = family(server)
    results, threads = start_streams(server.url, 2, max_tokens=1000)
    whole, whole_thread = start_whole(server.url, max_tokens=1000)
    server.process.send_signal(signal.SIGTERM)
    for thread in [*threads, whole_thread]:
        thread.join(30)
    for result in results:
        assert result.done and "shut down" in result.events[-1]["error"]["message"]
    [response] = whole
    assert response.status_code == 503 and "shut down" in response.json()["error"]["message"]
    assert wait_exit(server, 30) == 0, server.log()
    assert_no_process_left(pids)


def test_a_core_that_fails_to_start_makes_serve_exit_non_zero_with_the_reason(tiny_llama_dir, tmp_path):
    server = ServerProcess(tiny_llama_dir, ["--kv-cache-memory", "1KiB"], tmp_path / "server.log")
    assert wait_exit(server, 90) == 1  # like every configuration error (uvicorn exits 3 when an app fails)
    log = server.log()
    assert "prefixcache serve: kv_cache_memory '1KiB' (--kv-cache-memory) holds fewer than 2 KV blocks" in log
    assert "Traceback" not in log


def test_a_port_in_use_fails_at_once_before_the_model_loads(tiny_llama_dir):
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "prefixcache.cli", "serve", str(tiny_llama_dir), *ARGS, "--port", str(port)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert (
        done.stderr.strip().splitlines()[-1]
        == f"prefixcache serve: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
    assert "Traceback" not in done.stderr and "Waiting for application startup" not in done.stderr + done.stdout


def test_the_startup_log_names_the_model_cache_tiers_and_events(server, tiny_llama_dir):
    log = server.log()
    assert (
        f"model {tiny_llama_dir.name} (LlamaForCausalLM) from {tiny_llama_dir}: float32 on cpu, context 256 tokens"
        in log
    )
    # 512 blocks x 4 tokens x 2 layers x (K, V) x 2 KV heads x 16 dims x 4 bytes
    assert "KV cache: 512 blocks of 4 tokens (2,048 tokens, 1.0 MiB); prefix caching on (sha256)" in log
    assert "offload tiers: none" in log and "KV events: off" in log
