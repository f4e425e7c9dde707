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
import json
import random
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from prefixcache.bench.live import Process, free_port, running, scrape, warm_up
from prefixcache.bench.serve import Target, reset_prefix_cache, run_point, summarize
from prefixcache.core import Request, hittable_blocks
from prefixcache.core.hashing import root_hash


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
            hittable = hashes[: hittable_blocks(len(prompt), block_size)]
            found = next((k for k, h in enumerate(hittable) if h not in seen), len(hittable))
            hits += found * block_size
            total += len(prompt)
            seen.update(hashes)
        return hits / total if total else 0.0


def serve_args(args: argparse.Namespace, num_blocks: int) -> list[str]:
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{free_port()}",
        "replay_endpoint": f"tcp://*:{free_port()}",
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
        asyncio.run(warm_up(backends, model, vocab_size, args.user_len))
        for policy in args.policy:
            asyncio.run(_reset_all(backends))
            router_args = ["router", "--policy", policy, "--prefix-weight", str(args.prefix_weight)]
            router_args += [x for b in backends for x in ("--backend", b.url)]
            router_args += ["--tokenizer", card["root"], "--disable-uvicorn-access-log"]
            router = Process(router_args, logs / f"router-{policy}.log")
            with running([router], args.startup_timeout):
                results, duration = asyncio.run(_run_policy(router.url, model, workload, args))
                metrics = scrape(router.url, "backend")
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
