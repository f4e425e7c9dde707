"""``prefixcache bench route live``: N backends and routers in front of them on loopback, one table.

Backends (``--backend-kind``): ``prefixcache serve`` processes, or vLLM CPU servers started with the script
``--vllm-serve`` names (``serve.sh MODEL_DIR PORT DTYPE [vLLM flags]``, e.g. the side-by-side peers'
``vllm-cpu/serve.sh``), both with KV events on and room for about their share of the tenants' prefixes plus
one, never all of them, so where a request lands decides whether it hits.

Routers, each run over the same requests after every backend's cache was reset: ours per ``--policy``
(with ``--replicas`` > 1 also the prefix policy with affinity off: events alone), and with
``--compare-peers`` the peers installed into their own venvs (``prefixcache.bench.peers``): vllm-router
``kv_aware`` fed by the backends' KV events, vllm-router ``cache_aware`` and sglang-router ``cache_aware``
(trees of the request text each one routed). With ``--replicas R`` every router runs R processes and the
requests are dealt among them in turn, as a load balancer in front of the replicas would.

Workloads, in text (sglang-router takes no token-id prompts) made of random lowercase words, so that a
prompt's length in tokens is known from its words:

- ``tenants``: T tenants with their own random system prompt of about ``system_len`` tokens; each request
  one tenant's system prompt plus about ``user_len`` tokens of its own, tenants drawn at random (Poisson
  arrivals).
- ``fleet``, where a stale picture of the caches costs: conversations of ``--turns`` turns whose prompt
  grows (each turn is the previous prompt, an answer-sized run of words and a new user message; what can
  hit is the previous prompt), tenants' popularity moving in ``--phases`` (a Zipf order rotated at each
  phase), one backend's cache reset when half the requests are sent, and with ``--backend-offload-cpu``
  a host tier on each prefixcache backend.

Reported per router: the hit rate the backends report (usage ``cached_tokens``) against the ideal (an
infinite cache, over the requests in the order they were sent), mean and p90 TTFT, requests per backend
(from the backends' own request counters) and, for ours, predicted against reported cached tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import string
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from prefixcache.bench.live import ExternalProcess, Process, free_port, running, scrape, warm_up
from prefixcache.bench.serve import (
    RequestResult,
    Target,
    reset_prefix_cache,
    send_request,
    streaming_client,
    summarize,
)
from prefixcache.config import EngineConfig
from prefixcache.core import Request, hittable_blocks
from prefixcache.core.hashing import root_hash
from prefixcache.engine.input_processor import tokenize_prompt

VLLM_SERVE_ENV = "PREFIXCACHE_VLLM_SERVE"
WORKLOADS = ("tenants", "fleet")
BACKEND_KINDS = ("prefixcache", "vllm")
PEERS = ("vllm-router kv_aware", "vllm-router cache_aware", "sglang-router cache_aware")
# What every backend counts once per finished request, ours and vLLM's.
_REQUEST_COUNTERS = ("prefixcache:request_success_total", "vllm:request_success_total")


def ideal_hit_rate(prompts: Sequence[Sequence[int]], block_size: int) -> float:
    """The token hit rate of an infinite cache: each request finds every full block an earlier one filled."""
    seen: set[bytes] = set()
    root = root_hash("sha256")
    hits = total = 0
    for i, prompt in enumerate(prompts):
        hashes = Request(str(i), list(prompt)).hash_blocks("sha256", root, 0, len(prompt) // block_size, block_size)
        hittable = hashes[: hittable_blocks(len(prompt), block_size)]
        found = next((k for k, h in enumerate(hittable) if h not in seen), len(hittable))
        hits += found * block_size
        total += len(prompt)
        seen.update(hashes)
    return hits / total if total else 0.0


class Words:
    """Random lowercase words with their length in tokens (each word after a space: a byte-level BPE splits
    text there, so a prompt's tokens are its words' tokens)."""

    def __init__(self, tokenizer: Any, rng: random.Random, count: int = 4096) -> None:
        letters = string.ascii_lowercase
        self.words = sorted({"".join(rng.choices(letters, k=rng.randint(3, 8))) for _ in range(count)})
        self.tokens = [len(tokenizer.encode(" " + w, add_special_tokens=False)) for w in self.words]

    def text(self, rng: random.Random, num_tokens: int) -> str:
        """Words adding up to at least ``num_tokens`` tokens."""
        out, total = [], 0
        while total < num_tokens:
            k = rng.randrange(len(self.words))
            out.append(" " + self.words[k])
            total += self.tokens[k]
        return "".join(out)


@dataclass(frozen=True, slots=True)
class Conversation:
    """``turns`` are whole prompts, each sent once the one before it answered, ``think`` seconds later."""

    start: float
    tenant: int
    turns: list[str]
    think: float = 0.0


@dataclass(frozen=True, slots=True)
class LiveWorkload:
    conversations: list[Conversation]

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    @property
    def prompts(self) -> list[str]:
        return [turn for c in self.conversations for turn in c.turns]

    @property
    def tenants(self) -> list[int]:
        return [c.tenant for c in self.conversations for _ in c.turns]

    @classmethod
    def make(
        cls, seed: int, tokenizer: Any, tenants: int, system_len: int, user_len: int, num_requests: int, rate=1.0
    ) -> LiveWorkload:
        """Single-turn requests of random tenants, Poisson arrivals at ``rate``."""
        rng = random.Random(seed)
        words = Words(tokenizer, rng)
        systems = [words.text(rng, system_len) for _ in range(tenants)]
        start, conversations = 0.0, []
        for _ in range(num_requests):
            tenant = rng.randrange(tenants)
            conversations.append(Conversation(start, tenant, [systems[tenant] + words.text(rng, user_len)]))
            start += rng.expovariate(rate)
        return cls(conversations)

    @classmethod
    def fleet(
        cls,
        seed: int,
        tokenizer: Any,
        tenants: int,
        system_len: int,
        user_len: int,
        num_requests: int,
        rate: float,
        turns: int,
        phases: int,
        answer_len: int,
        think: float,
    ) -> LiveWorkload:
        """Conversations of ``turns`` growing prompts; tenants drawn by Zipf over an order rotated per phase."""
        rng = random.Random(seed)
        words = Words(tokenizer, rng)
        systems = [words.text(rng, system_len) for _ in range(tenants)]
        count = -(-num_requests // turns)
        weights = [1.0 / (rank + 1) for rank in range(tenants)]
        start, conversations = 0.0, []
        for c in range(count):
            shift = (c * phases // count) * tenants // phases
            tenant = (rng.choices(range(tenants), weights)[0] + shift) % tenants
            prompt = systems[tenant] + words.text(rng, user_len)
            prompts = [prompt]
            for _ in range(turns - 1):
                prompt = prompt + words.text(rng, answer_len) + words.text(rng, user_len)
                prompts.append(prompt)
            conversations.append(Conversation(start, tenant, prompts, think))
            start += rng.expovariate(rate / turns)
        return cls(conversations)


@dataclass(slots=True)
class Backend:
    process: Process
    events_port: int
    replay_port: int

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"


@dataclass(frozen=True, slots=True)
class RouterRow:
    """One router configuration; ``replica`` starts its i-th process over the backends; ``predicts``: ours
    with the prefix policy, whose predicted cached tokens are read from its metrics."""

    name: str
    replica: Callable[[int, Path], Process]
    predicts: bool = False


@dataclass(slots=True)
class RunContext:
    args: argparse.Namespace
    backends: list[Backend]
    model: str
    tokenizer_dir: Path
    tokenizer: Any
    block_size: int
    logs: Path
    peers: dict[str, Path] = field(default_factory=dict)


def _events_config(events_port: int, replay_port: int) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events_port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
        }
    )


def serve_args(args: argparse.Namespace, num_blocks: int, events_port: int, replay_port: int) -> list[str]:
    model = [args.model] if args.model else []
    offload = ["--kv-offload-cpu", args.backend_offload_cpu] if args.backend_offload_cpu else []
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
        _events_config(events_port, replay_port),
        *offload,
        "--disable-uvicorn-access-log",
        "--disable-log-stats",
    ]


def vllm_command(
    args: argparse.Namespace, model_dir: Path, port: int, num_blocks: int, events: tuple[int, int]
) -> list[str]:
    """vLLM's OpenAI server through ``--vllm-serve`` (MODEL_DIR PORT DTYPE, then vLLM's own flags)."""
    return [
        args.vllm_serve,
        str(model_dir),
        str(port),
        args.dtype,
        "--block-size",
        str(args.block_size),
        "--num-gpu-blocks-override",
        str(num_blocks),
        "--max-model-len",  # vLLM refuses a context its cache cannot hold once (it keeps a block back)
        str((num_blocks - 1) * args.block_size),
        "--kv-events-config",
        _events_config(*events),
        "--uvicorn-log-level",
        "warning",
    ]


def default_num_blocks(args: argparse.Namespace) -> int:
    """Room for an engine's share of the tenants' prompts plus one more: too small for all of them."""
    per_request = args.system_len + args.turns * (args.user_len + args.output_len)
    return (args.tenants // args.engines + 1) * -(-per_request // args.block_size)


def start_backends(args: argparse.Namespace, model_dir: Path, num_blocks: int, logs: Path) -> list[Backend]:
    backends = []
    for i in range(args.engines):
        ports = (free_port(), free_port())
        if args.backend_kind == "vllm":
            # vLLM binds its model threads to cores; give each server its own, and its reset endpoint
            env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}
            port = free_port()
            command = vllm_command(args, model_dir, port, num_blocks, ports)
            process: Process = ExternalProcess(command, port, logs / f"vllm-{i}.log", env)
        else:
            process = Process(serve_args(args, num_blocks, *ports), logs / f"serve-{i}.log")
        backends.append(Backend(process, *ports))
    return backends


def router_rows(ctx: RunContext) -> list[RouterRow]:
    args, backends = ctx.args, ctx.backends
    urls = [b.url for b in backends]

    def ours(policy: str, affinity: float) -> Callable[[int, Path], Process]:
        def start(i: int, logs: Path) -> Process:
            command = ["router", "--policy", policy, "--prefix-weight", str(args.prefix_weight)]
            command += ["--affinity-balance", str(affinity), "--tokenizer", str(ctx.tokenizer_dir)]
            command += [x for url in urls for x in ("--backend", url)]
            if args.backend_kind == "vllm":
                command += [x for b in backends for x in ("--kv-event-source", f"{b.url}={b.events}")]
                command += [x for b in backends for x in ("--kv-event-replay-source", f"{b.url}={b.replay}")]
                command += ["--kv-event-block-size", str(ctx.block_size)]
            return Process([*command, "--disable-uvicorn-access-log"], logs / f"router-{policy}-{affinity}-{i}.log")

        return start

    def peer(tool: str, policy: str) -> Callable[[int, Path], Process]:
        def start(i: int, logs: Path) -> Process:
            port = free_port()
            command = [str(ctx.peers[tool])]
            if tool == "sglang-router":
                command.append("launch")
            command += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy]
            command += ["--prometheus-port", str(free_port())]
            if policy == "kv_aware":
                command += [x for b in backends for x in ("--kv-event-source", f"{b.url}={b.events}")]
                command += [x for b in backends for x in ("--kv-event-replay-source", f"{b.url}={b.replay}")]
                command += ["--kv-event-block-size", str(ctx.block_size), "--kv-event-model", ctx.model]
            workers = len(urls) if tool == "sglang-router" else None  # it registers them after it answers
            return ExternalProcess(command, port, logs / f"{tool}-{policy}-{i}.log", workers=workers)

        return start

    rows = [RouterRow(f"prefixcache {p}", ours(p, args.affinity_balance), p == "prefix") for p in args.policy]
    if args.replicas > 1 and "prefix" in args.policy:
        rows.insert(1, RouterRow("prefixcache prefix, affinity off", ours("prefix", 0.0), predicts=True))
    if args.compare_peers:
        for name in PEERS:
            tool, policy = name.split()
            rows.append(RouterRow(name, peer(tool, policy)))
    return rows


def install_peers(ctx: RunContext) -> None:
    from prefixcache.bench.peers import PeerInstallError, ensure_installed

    for tool in sorted({name.split()[0] for name in PEERS}):
        try:
            ctx.peers[tool] = ensure_installed(tool)
        except PeerInstallError as exc:
            raise SystemExit(f"--compare-peers: {exc}") from None


async def send_workload(
    routers: Sequence[str], model: str, workload: LiveWorkload, args: argparse.Namespace, reset: str | None
) -> tuple[list[RequestResult], list[str], float]:
    """Every conversation from its start time, its turns in order, requests dealt to the routers in turn;
    ``reset``: a backend whose cache is reset once half the requests are sent. Returns the results, the
    prompts in the order sent, and the wall time."""
    sent: list[str] = []
    results: list[RequestResult] = []
    half = workload.num_requests // 2
    resets: list[asyncio.Task[None]] = []
    async with streaming_client(args.timeout) as client:
        begin = time.perf_counter()

        async def reset_when_possible(url: str) -> None:
            """An engine refuses a reset while requests hold blocks (vLLM too): ask again until it is done."""
            deadline = time.monotonic() + args.timeout
            while not (done := await reset_prefix_cache(client, url, {})):
                if done is None or time.monotonic() > deadline:
                    raise SystemExit(f"{url} did not reset its prefix cache")
                await asyncio.sleep(0.2)

        async def converse(conversation: Conversation) -> None:
            await asyncio.sleep(max(0.0, conversation.start - (time.perf_counter() - begin)))
            for k, prompt in enumerate(conversation.turns):
                if k:
                    await asyncio.sleep(conversation.think)
                target = Target(routers[len(sent) % len(routers)], model, {})
                sent.append(prompt)
                if reset is not None and len(sent) == half:
                    resets.append(asyncio.create_task(reset_when_possible(reset)))
                results.append(await send_request(client, target, prompt, args.output_len))

        await asyncio.gather(*(converse(c) for c in workload.conversations))
        await asyncio.gather(*resets)
        return results, sent, time.perf_counter() - begin


def _requests_served(backends: Sequence[Backend]) -> list[float]:
    counts = []
    for backend in backends:
        metrics = scrape(backend.url, "finished_reason")
        counts.append(sum(v for (name, _), v in metrics.items() if name in _REQUEST_COUNTERS))
    return counts


async def _reset_all(backends: Sequence[Backend]) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        for backend in backends:
            if not await reset_prefix_cache(client, backend.url, {}):
                raise SystemExit(f"{backend.url} did not reset its prefix cache")


def run_row(ctx: RunContext, row: RouterRow, workload: LiveWorkload) -> dict[str, Any]:
    args = ctx.args
    asyncio.run(_reset_all(ctx.backends))
    before = _requests_served(ctx.backends)
    replicas = [row.replica(i, ctx.logs) for i in range(args.replicas)]
    with running(replicas, args.startup_timeout):
        reset = ctx.backends[0].url if args.workload == "fleet" else None
        results, sent, duration = asyncio.run(
            send_workload([r.url for r in replicas], ctx.model, workload, args, reset)
        )
        router_metrics = [scrape(r.url, "backend") for r in replicas] if row.predicts else []
    after = _requests_served(ctx.backends)
    name = "prefixcache:router_predicted_cached_tokens_total"
    predicted = sum(v for m in router_metrics for (sample, _), v in m.items() if sample == name)
    return {
        "router": row.name,
        "replicas": args.replicas,
        "workload": args.workload,
        "backend_kind": args.backend_kind,
        "engines": args.engines,
        "tenants": args.tenants,
        "ideal_hit_rate": ideal_hit_rate(
            [tokenize_prompt(ctx.tokenizer, p)[1] for p in sent],
            ctx.block_size,  # as the backends run them
        ),
        **summarize(results, duration, percentiles=(90, 99)),
        "requests_per_backend": [a - b for a, b in zip(after, before, strict=True)],
        "predicted_cached_tokens": predicted if row.predicts else None,
        "reported_cached_tokens": sum(r.cached_tokens or 0 for r in results if r.success),
    }


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Defaults that depend on the workload and the backends: a fleet has 3 turns and 2 replicas per router,
    vLLM's CPU backend wants blocks of 32."""
    fleet = args.workload == "fleet"
    if args.turns is not None and args.turns > 1 and not fleet:
        raise SystemExit("--turns > 1 is for --workload fleet")
    if args.backend_kind == "vllm" and not args.vllm_serve:
        raise SystemExit(f"--backend-kind vllm needs --vllm-serve SCRIPT (or ${VLLM_SERVE_ENV})")
    if args.backend_kind == "vllm" and args.backend_offload_cpu:
        raise SystemExit("--backend-offload-cpu is for prefixcache backends")
    resolved = {
        "dtype": EngineConfig(dtype=args.dtype).dtype,  # auto as this machine resolves it, for vLLM's script too
        "turns": args.turns or (3 if fleet else 1),
        "replicas": args.replicas or (2 if fleet else 1),
        "block_size": args.block_size or (32 if args.backend_kind == "vllm" else 16),
    }
    return argparse.Namespace(**{**vars(args), **resolved})


def run_live(args: argparse.Namespace) -> list[dict[str, Any]]:
    from prefixcache.model.loader import load_tokenizer, resolve_model

    args = resolve_defaults(args)
    model_dir = resolve_model(args.model)[0]
    num_blocks = args.num_blocks or default_num_blocks(args)
    logs = Path(tempfile.mkdtemp(prefix="prefixcache-route-"))
    print(
        f"live ({args.workload}): {args.engines} {args.backend_kind} backends of {num_blocks} blocks x "
        f"{args.block_size} tokens; {args.tenants} tenants, system prompts of {args.system_len} + {args.user_len} "
        f"own tokens, {args.turns} turn(s), {args.output_len} output tokens, {args.num_requests} requests at "
        f"{args.request_rate}/s; {args.replicas} replica(s) per router; logs in {logs}"
    )
    backends = start_backends(args, model_dir, num_blocks, logs)
    rows = []
    with running([b.process for b in backends], args.startup_timeout):
        model = httpx.get(f"{backends[0].url}/v1/models", timeout=10).json()["data"][0]["id"]
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        tokenizer = load_tokenizer(model_dir)
        ctx = RunContext(args, backends, model, model_dir, tokenizer, args.block_size, logs)
        if args.compare_peers:
            install_peers(ctx)
        if args.workload == "fleet":
            workload = LiveWorkload.fleet(
                args.seed, tokenizer, args.tenants, args.system_len, args.user_len, args.num_requests,
                args.request_rate, args.turns, args.phases, args.output_len, args.think_time,
            )  # fmt: skip
        else:
            workload = LiveWorkload.make(
                args.seed, tokenizer, args.tenants, args.system_len, args.user_len, args.num_requests,
                args.request_rate,
            )  # fmt: skip
        asyncio.run(warm_up([b.process for b in backends], model, vocab_size, args.user_len))
        for row in router_rows(ctx):
            result = run_row(ctx, row, workload)
            print_row(result)
            rows.append(result)
    print(format_table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot is not None:
        plot_live(rows, args.plot)
    return rows


def _spread(per_backend: Sequence[float]) -> str:
    counts = [int(n) for n in per_backend]
    ratio = f"{max(counts) / min(counts):.2f}" if min(counts) else "inf"
    return f"{' / '.join(map(str, counts))} (max/min {ratio})"


def print_row(row: dict[str, Any]) -> None:
    hit_rate = row["hit_rate"] or 0.0
    ideal = row["ideal_hit_rate"]
    predicted = "-" if row["predicted_cached_tokens"] is None else f"{row['predicted_cached_tokens']:.0f}"
    print(
        f"{row['router']:<34} hit rate {hit_rate:.3f} ({hit_rate / ideal if ideal else 0:.2f} of ideal {ideal:.3f}) | "
        f"TTFT mean {row['mean_ttft_ms']:.0f} / p90 {row['p90_ttft_ms']:.0f} ms | requests per backend "
        f"{_spread(row['requests_per_backend'])} | cached tokens predicted {predicted}, reported "
        f"{row['reported_cached_tokens']:.0f} | {row['completed']} ok, {row['failed']} failed"
    )
    for error in row["errors"]:
        print(f"  error: {error}")


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The README's table: one line per router."""
    lines = [
        f"| router | hit rate (ideal {rows[0]['ideal_hit_rate']:.3f}) | mean / p90 TTFT ms | requests per backend | "
        "cached tokens predicted / reported |",
        "|---|---:|---:|---|---:|",
    ]
    for row in rows:
        predicted = "–" if row["predicted_cached_tokens"] is None else f"{row['predicted_cached_tokens']:,.0f}"
        lines.append(
            f"| {row['router']} | {row['hit_rate'] or 0.0:.3f} | {row['mean_ttft_ms']:.0f} / {row['p90_ttft_ms']:.0f} "
            f"| {' / '.join(str(int(n)) for n in row['requests_per_backend'])} | "
            f"{predicted} / {row['reported_cached_tokens']:,.0f} |"
        )
    return "\n".join(lines)


def plot_live(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Hit rate (with the ideal) and mean TTFT per router."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(10, 1.6 * len(rows)), 4.5))
    FigureCanvasAgg(fig)
    hits, ttft = fig.subplots(1, 2)
    names = [r["router"].replace(" ", "\n", 1) for r in rows]
    hits.bar(names, [r["hit_rate"] or 0.0 for r in rows])
    hits.axhline(rows[0]["ideal_hit_rate"], linestyle=":", color="gray", label="ideal (infinite cache)")
    hits.set_ylabel("prompt token hit rate")
    hits.legend()
    ttft.bar(names, [r["mean_ttft_ms"] for r in rows], color="tab:orange")
    ttft.set_ylabel("mean TTFT (ms)")
    for axes in (hits, ttft):
        axes.tick_params(axis="x", labelsize=7)
    first = rows[0]
    fig.suptitle(
        f"{first['engines']} {first['backend_kind']} backends, {first['tenants']} tenants, {first['workload']} "
        f"workload, {first['replicas']} replica(s) per router"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
