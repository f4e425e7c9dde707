"""``prefixcache bench offload``: the KV offload tiers on real ``prefixcache serve`` processes on loopback.

Three parts, each against a baseline on the same token ids, every request streamed and sent alone (so
TTFT is the prefill the cache saves, not queueing):

- ``host``: a multi-turn chat. C conversations take turns round-robin; each turn's prompt is the
  conversation so far (previous prompt, the server's own output ids, then U new random ids). The device
  cache holds about a quarter of the working set (all final prompts), so LRU evicts a conversation before
  its next turn; run once without a tier and once with ``--kv-offload-cpu`` large enough for everything.
- ``disk``: server A with ``--kv-offload-disk`` on an empty directory (the cold start) serves N prompts of
  different prefixes and is stopped; server B on the same directory sends them again (the first pass
  after a restart).
- ``redis``: a ``redis-server`` on a free loopback port; engine 1 with ``--kv-offload-redis`` on the empty
  Redis (the cold start) computes the prompts, engine 2, another process on the same Redis, sends them.

Reported: TTFT (mean, median, p90), the server-reported hit rate (cached_tokens / prompt_tokens), the
tokens each tier served (its /metrics), and the mean TTFT ratio against the baseline with its goal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from prefixcache.argtypes import positive_int
from prefixcache.bench.live import Process, RedisServer, scrape, served_model, warm_up
from prefixcache.bench.serve import RequestResult, Target, run_point, send_request, streaming_client, summarize
from prefixcache.config import DTYPES, EngineConfig, parse_memory
from prefixcache.engine.args import config_default
from prefixcache.offload.connector import OFFLOAD_MODES, WRITE_BACK

PARTS = ("host", "disk", "redis")
COLORS = {"host": "tab:blue", "disk": "tab:orange", "redis": "tab:green"}
GOALS = {"host": 0.6, "disk": 0.5}  # TTFT with the tier over TTFT without, at most
# SmolLM2-135M in bfloat16 (emulated: no avx512_bf16), one request at a time, on the 2 shared cores of
# the project's machine while other work ran: only for the printed estimate.
PREFILL_TOKENS_PER_S = 100.0
DECODE_TOKENS_PER_S = 15.0
SERVER_START_S = 20.0
TIER_HIT_TOKENS = "prefixcache:kv_offload_hit_tokens_total"
_NOT_OPTIONS = {"func", "command", "bench", "log_level"}  # the CLI's own, not this benchmark's
REDIS_BLOCK_KEYS = "prefixcache:*:kv:*"  # docs/offload.md: prefixcache:<namespace>:kv:<block hash>


def _parts(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names or any(n not in PARTS for n in names):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(PARTS)}")
    return names


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _memory(text: str) -> int:
    try:
        return parse_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class Chat:
    """The host part's workload: ``messages[c][t]`` is conversation c's user message at turn t."""

    messages: list[list[list[int]]]
    output_len: int

    @classmethod
    def make(cls, rng: random.Random, vocab_size: int, args: argparse.Namespace) -> Chat:
        draw = range(2, vocab_size)  # clear of the usual special ids at the bottom of a vocabulary
        return cls(
            [[rng.choices(draw, k=args.user_len) for _ in range(args.turns)] for _ in range(args.conversations)],
            args.output_len,
        )

    @property
    def turns(self) -> int:
        return len(self.messages[0])

    def prompt_len(self, turn: int) -> int:
        """Tokens of a turn's prompt: every earlier message and output, then the new message."""
        return (turn + 1) * len(self.messages[0][0]) + turn * self.output_len

    @property
    def working_set(self) -> int:
        """Tokens of all conversations' final prompts: what a cache needs to hold for every turn to hit."""
        return len(self.messages) * self.prompt_len(self.turns - 1)

    @property
    def prompt_tokens(self) -> int:
        return len(self.messages) * sum(self.prompt_len(t) for t in range(self.turns))

    @property
    def new_tokens(self) -> int:
        """Prompt tokens in no earlier prompt of their conversation: each new message and the output before it."""
        return self.prompt_tokens - len(self.messages) * sum(self.prompt_len(t - 1) for t in range(1, self.turns))

    @property
    def num_requests(self) -> int:
        return len(self.messages) * self.turns


@dataclass(slots=True)
class Bench:
    """What every part needs: the options, a working directory (logs, disk tier, Redis) and the model's shape."""

    args: argparse.Namespace
    workdir: Path
    vocab_size: int
    kv_bytes_per_token: int

    def launch(self, stack: contextlib.ExitStack, name: str, extra: Sequence[str]) -> Process:
        """Start ``prefixcache serve`` with ``extra`` options; the stack stops and reaps it."""
        args = self.args
        command = ["serve", *([args.model] if args.model else []), "--block-size", str(args.block_size)]
        command += ["--dtype", args.dtype, "--seed", str(args.seed), *extra]
        command += ["--disable-uvicorn-access-log", "--disable-log-stats", "--disable-log-requests"]
        return stack.enter_context(Process(command, self.workdir / f"{name}.log"))

    def ready(self, servers: Sequence[Process], warm_up_len: int) -> str:
        """Wait for the servers and warm each one up; returns the model name they serve."""
        for server in servers:
            server.wait_ready(self.args.startup_timeout)
        model = httpx.get(f"{servers[0].url}/v1/models", timeout=10).json()["data"][0]["id"]
        asyncio.run(warm_up(servers, model, self.vocab_size, warm_up_len))
        return model

    def client(self) -> httpx.AsyncClient:
        return streaming_client(self.args.timeout)

    def prompts(self, count: int, part: str) -> list[list[int]]:
        """``count`` random prompts of ``--prompt-len`` ids, each its own prefix, the same for every run of a part."""
        rng = random.Random(f"{self.args.seed}-{part}")
        return [rng.choices(range(2, self.vocab_size), k=self.args.prompt_len) for _ in range(count)]

    def run_prompts(self, server: Process, model: str, prompts: list[list[int]], label: str) -> dict[str, Any]:
        """Send ``prompts`` one at a time and summarize what the client and the server's tiers saw."""

        async def send() -> tuple[list[RequestResult], float]:
            async with self.client() as client:
                target = Target(server.url, model, {})
                rng = random.Random(self.args.seed)
                return await run_point(
                    client, target, prompts, self.args.output_len, math.inf, 1, rng, self.announce(label)
                )

        before = tier_hit_tokens(server.url)
        results, duration = asyncio.run(send())
        return run_summary(server, label, results, duration, before)

    def announce(self, label: str) -> bool:
        """Name the run above its progress bar; whether to show the bar."""
        if not self.args.disable_tqdm:
            print(f"{label}:")
        return not self.args.disable_tqdm


def tier_hit_tokens(url: str) -> dict[str, float]:
    """Prompt tokens each tier has served so far, by tier (``cpu``, ``disk``, ``redis``)."""
    return {tier: value for (name, tier), value in scrape(url, "tier").items() if name == TIER_HIT_TOKENS}


def run_summary(
    server: Process, label: str, results: list[RequestResult], duration: float, tiers_before: dict[str, float]
) -> dict[str, Any]:
    """``bench serve``'s summary (with p90) plus cached tokens and each tier's hit tokens during the run.
    A failed request ends the benchmark: a ratio over part of the requests would mislead."""
    summary = summarize(results, duration, percentiles=(90, 99))
    if summary["failed"]:
        raise SystemExit(f"{label}: {summary['failed']} requests failed: {summary['errors']}\n{server.log()[-3000:]}")
    after = tier_hit_tokens(server.url)
    return {
        "label": label,
        **summary,
        "cached_tokens": sum(r.cached_tokens or 0 for r in results),
        "tier_hit_tokens": {tier: after[tier] - tiers_before.get(tier, 0.0) for tier in after},
    }


async def _chat(bench: Bench, server: Process, model: str, chat: Chat, label: str) -> list[RequestResult]:
    """Turn by turn, conversations round-robin; each prompt continues with the output ids the server sent."""
    from tqdm import tqdm

    history: list[list[int]] = [[] for _ in chat.messages]
    results = []
    target = Target(server.url, model, {})
    async with bench.client() as client:
        with tqdm(total=chat.num_requests, desc="turns", unit="req", disable=not bench.announce(label)) as bar:
            for turn in range(chat.turns):
                for c, messages in enumerate(chat.messages):
                    prompt = history[c] + messages[turn]
                    result = await send_request(client, target, prompt, chat.output_len, output_ids=True)
                    if result.success and len(result.output_token_ids) != result.output_tokens:
                        result.success = False
                        result.error = "the server did not return the output token ids (return_tokens_as_token_ids)"
                    if not result.success:
                        raise SystemExit(
                            f"{label}: conversation {c} turn {turn}: {result.error}\n{server.log()[-3000:]}"
                        )
                    history[c] = prompt + result.output_token_ids
                    results.append(result)
                    bar.update(1)
    return results


def run_host(bench: Bench) -> dict[str, Any]:
    args = bench.args
    chat = Chat.make(random.Random(f"{args.seed}-host"), bench.vocab_size, args)
    blocks = -(-math.ceil(chat.working_set * args.device_fraction) // args.block_size)
    needed = -(-(chat.prompt_len(chat.turns - 1) + args.output_len) // args.block_size)
    if blocks < needed:
        raise SystemExit(
            f"host: a device cache of {blocks} blocks ({args.device_fraction:g} of the working set) cannot hold the "
            f"last turn ({needed} blocks); use more --conversations or a larger --device-fraction"
        )
    cpu_bytes = args.cpu_tier_size or 2 * chat.working_set * bench.kv_bytes_per_token
    if cpu_bytes < chat.working_set * bench.kv_bytes_per_token:
        print(f"host: note: a CPU tier of {cpu_bytes:,} bytes is smaller than the working set")
    print(
        f"host: {len(chat.messages)} conversations x {chat.turns} turns of {args.user_len} new + {args.output_len} "
        f"output tokens; working set {chat.working_set:,} tokens "
        f"({chat.working_set * bench.kv_bytes_per_token / 2**20:.1f} MiB of KV); device cache {blocks} blocks "
        f"= {blocks * args.block_size:,} tokens ({blocks * args.block_size / chat.working_set:.2f} of it); "
        f"CPU tier {cpu_bytes / 2**20:.1f} MiB, {args.kv_offload_mode}"
    )
    runs = {}
    device = ["--num-gpu-blocks-override", str(blocks)]
    tier = ["--kv-offload-cpu", str(cpu_bytes), "--kv-offload-mode", args.kv_offload_mode]
    for name, label, extra in (("no_tier", "no tier", device), ("cpu_tier", "+ CPU tier", device + tier)):
        with contextlib.ExitStack() as stack:
            server = bench.launch(stack, f"host-{name}", extra)
            model = bench.ready([server], args.user_len)
            before = tier_hit_tokens(server.url)
            start = time.perf_counter()
            results = asyncio.run(_chat(bench, server, model, chat, f"host, {label}"))
            runs[name] = run_summary(server, label, results, time.perf_counter() - start, before)
    sizing = {
        "working_set_tokens": chat.working_set,
        "device_blocks": blocks,
        "device_tokens": blocks * args.block_size,
        "cpu_tier_bytes": cpu_bytes,
    }
    return {**sizing, **compare(runs, "cpu_tier", "no_tier", GOALS["host"])}


def run_disk(bench: Bench) -> dict[str, Any]:
    prompts = bench.prompts(bench.args.disk_prompts, "disk")
    tier = ["--kv-offload-disk", str(bench.workdir / "disk-tier")]
    runs = {}
    for name, label in (("cold", "cold, empty disk tier"), ("restart", "restarted, first pass")):
        with contextlib.ExitStack() as stack:
            server = bench.launch(stack, f"disk-{name}", tier)
            model = bench.ready([server], bench.args.prompt_len)
            runs[name] = bench.run_prompts(server, model, prompts, label)
    return compare(runs, "restart", "cold", GOALS["disk"])


def run_redis(bench: Bench) -> dict[str, Any]:
    (bench.workdir / "redis").mkdir()
    try:
        redis_server = RedisServer(bench.workdir / "redis")
    except FileNotFoundError as exc:
        reason = f"{exc}: install it (apt-get install -y redis-server) to run this part"
        print(f"redis: skipped, {reason}")
        return {"skipped": reason}
    prompts = bench.prompts(bench.args.redis_prompts, "redis")
    runs = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(redis_server)
        tier = ["--kv-offload-redis", redis_server.url]
        engines = [bench.launch(stack, f"redis-engine{i}", tier) for i in (1, 2)]
        model = bench.ready(engines, bench.args.prompt_len)
        runs["cold"] = bench.run_prompts(engines[0], model, prompts, "engine 1, empty Redis")
        wait_for_redis(redis_server.url, sum(len(p) // bench.args.block_size for p in prompts))
        runs["shared"] = bench.run_prompts(engines[1], model, prompts, "engine 2, same Redis")
    return {"redis_url": redis_server.url, **compare(runs, "shared", "cold", None)}


def wait_for_redis(url: str, minimum: int, timeout: float = 60.0) -> None:
    """Engine 1 writes to Redis in the background: wait until it holds the prompts' blocks and stops growing."""
    import redis

    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout
    last, stable_since = -1, time.monotonic()
    try:
        while time.monotonic() < deadline:
            count = sum(1 for _ in client.scan_iter(match=REDIS_BLOCK_KEYS, count=1000))
            if count != last:
                last, stable_since = count, time.monotonic()
            elif count >= minimum and time.monotonic() - stable_since >= 1.0:
                return
            time.sleep(0.2)
    finally:
        client.close()
    print(f"redis: note: Redis holds {last} blocks after {timeout:.0f}s, expected at least {minimum}")


def compare(runs: dict[str, dict[str, Any]], tier: str, baseline: str, goal: float | None) -> dict[str, Any]:
    """The runs with the mean TTFT ratio of ``tier`` over ``baseline`` and, where there is one, its goal."""
    ratio = runs[tier]["mean_ttft_ms"] / runs[baseline]["mean_ttft_ms"]
    return {"runs": runs, "ttft_ratio": ratio, "goal": goal, "goal_met": None if goal is None else ratio <= goal}


def estimate(args: argparse.Namespace, vocab_size: int) -> tuple[str, float]:
    """The work of the selected parts in words, and a rough time on SmolLM2-135M on 2 cores."""
    lines, seconds = [], 0.0
    if "host" in args.parts:
        chat = Chat.make(random.Random(0), vocab_size, args)
        computed = chat.prompt_tokens + chat.new_tokens  # no tier: (nearly) all; with it: the new tokens
        outputs = 2 * chat.num_requests * args.output_len
        lines.append(
            f"host: 2 servers x {chat.num_requests} requests, {chat.prompt_tokens:,} prompt tokens each "
            f"({chat.new_tokens:,} new)"
        )
        seconds += computed / PREFILL_TOKENS_PER_S + outputs / DECODE_TOKENS_PER_S + 2 * SERVER_START_S
    for part, count in (("disk", args.disk_prompts), ("redis", args.redis_prompts)):
        if part in args.parts:
            lines.append(f"{part}: 2 servers x {count} prompts of {args.prompt_len:,} tokens")
            outputs = 2 * count * args.output_len
            seconds += count * args.prompt_len / PREFILL_TOKENS_PER_S + outputs / DECODE_TOKENS_PER_S
            seconds += 2 * SERVER_START_S
    return "; ".join(lines), seconds


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    model_dir, model_name, config = served_model(args.model)
    engine = EngineConfig(dtype=args.dtype)  # the servers run this machine's resolution of auto too
    args = argparse.Namespace(**{**vars(args), "dtype": engine.dtype})
    cores = os.cpu_count() or 0
    machine = {"cores": cores, "python": platform.python_version(), "torch": torch.__version__}
    work, seconds = estimate(args, config.vocab_size)
    print(
        f"offload live: {model_name}, {args.dtype}, blocks of {args.block_size} tokens, {args.output_len} output "
        f"tokens a request, seed {args.seed}; {cores} cores, python {machine['python']}, torch {machine['torch']}"
    )
    print(f"dtype {engine.dtype_reason}")
    print(f"work: {work}; about {seconds / 60:.0f} min on SmolLM2-135M and 2 cores")
    runners = {"host": run_host, "disk": run_disk, "redis": run_redis}
    parts: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="prefixcache-offload-") as workdir:
        bench = Bench(
            args, Path(workdir), config.vocab_size, config.kv_bytes_per_token(getattr(torch, args.dtype).itemsize)
        )
        for part in args.parts:
            parts[part] = runners[part](bench)
    options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in _NOT_OPTIONS}
    report = {
        "config": {**options, "model": model_name, "model_dir": str(model_dir)},
        "machine": machine,
        "parts": parts,
    }
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot is not None:
        plot(report, args.plot)
    return report


def print_report(report: dict[str, Any]) -> None:
    print(f"\n{'part':<7}{'run':<26}{'requests':>9}{'TTFT mean':>11}{'median':>9}{'p90':>9}{'hit rate':>10}  tier hits")
    for part, result in report["parts"].items():
        if "skipped" in result:
            print(f"{part:<7}skipped: {result['skipped']}")
            continue
        for row in result["runs"].values():
            tiers = ", ".join(f"{tier} {tokens:,.0f}" for tier, tokens in row["tier_hit_tokens"].items() if tokens)
            print(
                f"{part:<7}{row['label']:<26}{row['completed']:>9}{row['mean_ttft_ms']:>9.0f}ms"
                f"{row['median_ttft_ms']:>7.0f}ms{row['p90_ttft_ms']:>7.0f}ms{row['hit_rate'] or 0.0:>10.3f}  "
                f"{tiers or '-'}"
            )
        goal = (
            ""
            if result["goal"] is None
            else f" (goal <= {result['goal']}: {'met' if result['goal_met'] else 'NOT met'})"
        )
        print(f"{'':<7}mean TTFT ratio {result['ttft_ratio']:.2f}{goal}")


def plot(report: dict[str, Any], path: Path) -> None:
    """Mean TTFT per run, grouped by part, with each part's ratio over its bars."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    parts = {part: result for part, result in report["parts"].items() if "skipped" not in result}
    fig = Figure(figsize=(3 + 2.5 * max(len(parts), 1), 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    positions: list[int] = []
    labels: list[str] = []
    for gap, (part, result) in enumerate(parts.items()):
        rows = list(result["runs"].values())
        xs = [len(positions) + gap + i for i in range(len(rows))]
        heights = [r["mean_ttft_ms"] for r in rows]
        ax.bar(xs, heights, color=COLORS[part], label=part)
        ax.text(sum(xs) / len(xs), max(heights) * 1.03, f"ratio {result['ttft_ratio']:.2f}", ha="center")
        positions += xs
        labels += [r["label"] for r in rows]
    ax.set_xticks(positions, labels)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.1)
    ax.legend()
    config = report["config"]
    fig.suptitle(f"KV offload tiers, {config['model']} ({config['dtype']}), {report['machine']['cores']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "offload",
        help="KV offload tiers on live servers: host tier on a multi-turn chat, disk restart, shared Redis",
        description=__doc__,
    )
    p.add_argument("--parts", type=_parts, default=list(PARTS), help="comma-separated parts (default: all)")
    p.add_argument("--model", help="HF checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=config_default("dtype"), choices=DTYPES, help="as prefixcache serve --dtype")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--output-len", type=positive_int, default=16, help="generated tokens per request (ignore_eos)")
    p.add_argument("--seed", type=int, default=0, help="the prompts depend only on it")
    host = p.add_argument_group("host part")
    host.add_argument("--conversations", type=positive_int, default=8)
    host.add_argument("--turns", type=positive_int, default=5)
    host.add_argument("--user-len", type=positive_int, default=128, help="new tokens of each user message")
    host.add_argument(
        "--device-fraction", type=_fraction, default=0.25, help="device cache size as a fraction of the working set"
    )
    host.add_argument(
        "--cpu-tier-size", type=_memory, help="host tier size, e.g. 1GiB (default: twice the working set)"
    )
    host.add_argument("--kv-offload-mode", default=WRITE_BACK, choices=OFFLOAD_MODES)
    prompts = p.add_argument_group("disk and redis parts")
    prompts.add_argument("--prompt-len", type=positive_int, default=800, help="tokens of each prompt")
    prompts.add_argument("--disk-prompts", type=positive_int, default=10)
    prompts.add_argument("--redis-prompts", type=positive_int, default=6)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a server to come up")
    p.add_argument("--json", type=Path, help="write the report as JSON here")
    p.add_argument("--plot", type=Path, help="write a PNG of mean TTFT per run here")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=run)
