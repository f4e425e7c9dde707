"""Real ``prefixcache serve`` processes for the server and benchmark tests, and a /metrics reader.

The server is :class:`prefixcache.bench.live.Process`: port 0 read back from its log, which failures show.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from prefixcache.bench.live import Process

API_KEY = "test-key"
OTHER_API_KEY = "other-test-key"  # a second tenant of the secured server
METRICS_API_KEY = "metrics-test-key"  # the secured server's /metrics key (--metrics-api-key)
# 4-token blocks make "more than one block" cheap; a 256-token context makes "too long" cheap.
SERVER_ARGS = ["--block-size", "4", "--num-blocks", "512", "--max-model-len", "256", "--disable-uvicorn-access-log"]


class ServerProcess(Process):
    """``prefixcache serve MODEL_DIR ARGS`` on a free loopback port, in float32 unless ARGS name a dtype (tests
    compare outputs exactly, with transformers or across engines; ``--dtype auto`` is bfloat16 on some CPUs)."""

    def __init__(self, model_dir: Path, args: list[str], log_path: Path) -> None:
        dtype = [] if "--dtype" in args else ["--dtype", "float32"]
        super().__init__(["serve", str(model_dir), *dtype, *args], log_path)

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Bounds a hang only: on two loaded cores, servers starting together each import torch and
        transformers, which can take minutes."""
        super().wait_ready(timeout)


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """How much ``prefixcache:<name>`` moved between two scrapes (a series not yet exported counts as 0)."""
    return after.get(f"prefixcache:{name}", 0.0) - before.get(f"prefixcache:{name}", 0.0)


def random_prompt(seed: int | str, length: int) -> list[int]:
    """Token ids no other test sends (by seed), clear of the tiny tokenizer's special ids 0 and 1."""
    rng = random.Random(seed)
    return [rng.randrange(2, 400) for _ in range(length)]


@dataclass
class StreamResult:
    """What one streamed completion received: its events (and when each arrived), whether ``[DONE]`` came."""

    events: list[dict] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    done: bool = False
    first_token: threading.Event = field(default_factory=threading.Event)
    ended_at: float | None = None
    error: BaseException | None = None


def stream_completion(url: str, seed: str, max_tokens: int, result: StreamResult) -> None:
    """Stream a greedy completion of a prompt of 12 ids drawn from ``seed`` into ``result`` (run it in a thread)."""
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
                    result.arrivals.append(time.monotonic())
                    result.first_token.set()
    except httpx.HTTPError as exc:
        result.error = exc
    finally:
        result.ended_at = time.monotonic()
        result.first_token.set()


def start_streams(url: str, count: int, max_tokens: int) -> tuple[list[StreamResult], list[threading.Thread]]:
    """``count`` concurrent streams of ``max_tokens`` tokens each, started once each has its first token."""
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
