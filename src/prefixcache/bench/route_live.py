"""``prefixcache bench route live``: N ``prefixcache serve`` processes and the router on loopback.

The workload is multi-tenant: T tenants, each with its own random system prompt of ``system_len``
token ids, and every request one tenant's system prompt plus ``user_len`` ids of its own; tenants are
drawn at random, so their requests interleave. By default each engine's cache holds about its share
of the tenants' prefixes plus one, never all of them, so where a request lands decides whether it hits.

For each policy the caches are reset, a router is started, and the same requests are sent through it
(Poisson arrivals, streamed, as ``bench serve`` does). Reported: TTFT, the hit rate the engines
report against the ideal (an infinite cache: every block some earlier request filled), requests per
backend, and the router's predicted against reported cached tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.bench.serve import Target, reset_prefix_cache, run_point, send_request, summarize
from prefixcache.core import Request
from prefixcache.core.hashing import root_hash

_READY = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")


@dataclass(frozen=True, slots=True)
class LiveWorkload:
    prompts: list[list[int]]
    tenants: list[int]  # the tenant of each prompt

    @classmethod
    def make(cls, seed: int, vocab_size: int, tenants: int, system_len: int, user_len: int, num_requests: int):
        rng = random.Random(seed)
        draw = range(2, vocab_size)  # clear of the usual special ids at the bottom of a vocabulary
        systems = [rng.choices(draw, k=system_len) for _ in range(tenants)]
        order = [rng.randrange(tenants) for _ in range(num_requests)]
        return cls([systems[t] + rng.choices(draw, k=user_len) for t in order], order)

    def ideal_hit_rate(self, block_size: int) -> float:
        """The token hit rate of an infinite cache: each request finds every full block an earlier one filled."""
        seen: set[bytes] = set()
        root = root_hash("sha256")
        hits = total = 0
        for i, prompt in enumerate(self.prompts):
            hashes = Request(str(i), prompt).hash_blocks("sha256", root, 0, len(prompt) // block_size, block_size)
            hittable = hashes[: (len(prompt) - 1) // block_size]
            found = next((k for k, h in enumerate(hittable) if h not in seen), len(hittable))
            hits += found * block_size
            total += len(prompt)
            seen.update(hashes)
        return hits / total if total else 0.0


class Process:
    """A ``prefixcache`` subcommand on a free loopback port; its output goes to a log file."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self.url = ""
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "prefixcache.cli", *args, "--host", "127.0.0.1", "--port", "0"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            log = self.log_path.read_text(errors="replace")
            if self.process.poll() is not None:
                raise SystemExit(f"{self.log_path.name} exited with {self.process.returncode}:\n{log[-3000:]}")
            match = _READY.search(log)
            if match:
                self.url = match.group(1)
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                        return
            time.sleep(0.2)
        raise SystemExit(f"{self.log_path.name} not ready after {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=15)


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_args(args: argparse.Namespace, num_blocks: int) -> list[str]:
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{_free_port()}",
        "replay_endpoint": f"tcp://*:{_free_port()}",
    }
    model = [args.model] if args.model else []
    return [
        "serve",
        *model,
        "--block-size",
        str(args.block_size),
        "--num-blocks",
        str(num_blocks),
        "--dtype",
        args.dtype,
        "--enable-reset-prefix-cache",
        "--kv-events-config",
        json.dumps(events),
        "--disable-uvicorn-access-log",
        "--disable-log-stats",
    ]


def default_num_blocks(args: argparse.Namespace) -> int:
    """Room for an engine's share of the tenants' requests plus one more: too small for all of them."""
    per_request = args.system_len + args.user_len + args.output_len
    return (args.tenants // args.engines + 1) * -(-per_request // args.block_size)


def scrape(url: str) -> dict[tuple[str, str], float]:
    """Router metrics as {(sample name, backend label): value}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (sample.name, sample.labels.get("backend", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def _warm_up(backends: Sequence[Process], model: str, vocab_size: int, prompt_len: int) -> None:
    """One request per backend, so first-call costs land outside the measurements."""
    async with httpx.AsyncClient(timeout=600) as client:
        for backend in backends:
            target = Target(backend.url, model, {})
            result = await send_request(client, target, random.Random(0).choices(range(2, vocab_size), k=prompt_len), 2)
            if not result.success:
                raise SystemExit(f"warm-up on {backend.url} failed: {result.error}")


async def _run_policy(router_url: str, model: str, workload: LiveWorkload, args: argparse.Namespace):
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        target = Target(router_url, model, {})
        return await run_point(
            client, target, workload.prompts, args.output_len, args.request_rate, None, random.Random(args.seed), False
        )


async def _reset_all(backends: Sequence[Process]) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        for backend in backends:
            if not await reset_prefix_cache(client, backend.url, {}):
                raise SystemExit(f"{backend.url} did not reset its prefix cache")


def run_live(args: argparse.Namespace) -> list[dict[str, Any]]:
    num_blocks = args.num_blocks or default_num_blocks(args)
    logs = Path(tempfile.mkdtemp(prefix="prefixcache-route-"))
    print(
        f"live: {args.engines} engines of {num_blocks} blocks x {args.block_size} tokens; {args.tenants} tenants, "
        f"system prompts of {args.system_len} + {args.user_len} own tokens, {args.output_len} output tokens, "
        f"{args.num_requests} requests at {args.request_rate}/s; logs in {logs}"
    )
    backends = [Process(serve_args(args, num_blocks), logs / f"serve-{i}.log") for i in range(args.engines)]
    rows = []
    with running(backends, args.startup_timeout):
        card = httpx.get(f"{backends[0].url}/v1/models", timeout=10).json()["data"][0]
        model, vocab_size = card["id"], card["vocab_size"]
        workload = LiveWorkload.make(
            args.seed, vocab_size, args.tenants, args.system_len, args.user_len, args.num_requests
        )
        ideal = workload.ideal_hit_rate(args.block_size)
        asyncio.run(_warm_up(backends, model, vocab_size, args.user_len))
        for policy in args.policy:
            asyncio.run(_reset_all(backends))
            router_args = ["router", "--policy", policy, "--prefix-weight", str(args.prefix_weight)]
            router_args += [x for b in backends for x in ("--backend", b.url)]
            router_args += ["--tokenizer", card["root"], "--disable-uvicorn-access-log"]
            router = Process(router_args, logs / f"router-{policy}.log")
            with running([router], args.startup_timeout):
                results, duration = asyncio.run(_run_policy(router.url, model, workload, args))
                metrics = scrape(router.url)
            row = {
                "policy": policy,
                "engines": args.engines,
                "num_blocks": num_blocks,
                "tenants": args.tenants,
                "ideal_hit_rate": ideal,
                **summarize(results, duration),
                "requests_per_backend": [
                    metrics.get(("prefixcache:router_requests_total", b.url), 0.0) for b in backends
                ],
                "predicted_cached_tokens": sum(
                    v for (name, _), v in metrics.items() if name == "prefixcache:router_predicted_cached_tokens_total"
                )
                if policy == "prefix"
                else None,  # only the prefix policy reads prompts
                "reported_cached_tokens": sum(
                    v for (name, _), v in metrics.items() if name == "prefixcache:router_reported_cached_tokens_total"
                ),
            }
            print_row(row)
            rows.append(row)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot is not None:
        plot_live(rows, args.plot)
    return rows


def print_row(row: dict[str, Any]) -> None:
    hit_rate = row["hit_rate"] or 0.0
    per_backend = [int(n) for n in row["requests_per_backend"]]
    spread = max(per_backend) / min(per_backend) if min(per_backend) else float("inf")
    predicted = "-" if row["predicted_cached_tokens"] is None else f"{row['predicted_cached_tokens']:.0f}"
    print(
        f"{row['policy']:<12} hit rate {hit_rate:.3f} ({hit_rate / row['ideal_hit_rate']:.2f} of ideal "
        f"{row['ideal_hit_rate']:.3f}) | TTFT mean {row['mean_ttft_ms']:.0f} / median {row['median_ttft_ms']:.0f} / "
        f"p99 {row['p99_ttft_ms']:.0f} ms | requests per backend {per_backend} (max/min {spread:.2f}) | "
        f"cached tokens predicted {predicted}, reported {row['reported_cached_tokens']:.0f}"
        f" | {row['completed']} ok, {row['failed']} failed"
    )
    for error in row["errors"]:
        print(f"  error: {error}")


def plot_live(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Hit rate (with the ideal) and mean TTFT per policy."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    hits, ttft = fig.subplots(1, 2)
    names = [r["policy"] for r in rows]
    hits.bar(names, [r["hit_rate"] or 0.0 for r in rows])
    hits.axhline(rows[0]["ideal_hit_rate"], linestyle=":", color="gray", label="ideal (infinite cache)")
    hits.set_ylabel("prompt token hit rate")
    hits.legend()
    ttft.bar(names, [r["mean_ttft_ms"] for r in rows], color="tab:orange")
    ttft.set_ylabel("mean TTFT (ms)")
    fig.suptitle(f"{rows[0]['engines']} engines, {rows[0]['tenants']} tenants")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
