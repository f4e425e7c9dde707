"""``prefixcache bench route``: routing policies over several engines, simulated on a trace or live.

``sim`` replays a Mooncake trace (see ``bench trace``) through N real ``KVCacheManager``s with the same
holding cost model. Before each request the router's own :class:`~prefixcache.router.index.PrefixIndex`,
fed by a listener on every engine's block pool, and its policy pick the engine, exactly as the live
router would from KV events. Reported per policy: the token hit rate, requests and computed prompt
tokens per engine, against one engine with N times the capacity and the infinite-cache bound.

``live`` starts N ``prefixcache serve`` processes (KV events on) and the router on loopback, then sends
a multi-tenant workload: T tenants, each with its own long system prompt, requests interleaved at
random, each engine's cache too small for every tenant's prefix. Reported per policy: TTFT, the hit
rate the engines report, requests per backend, against the workload's ideal (an infinite cache).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from prefixcache.argtypes import positive_int
from prefixcache.bench.trace import (
    TRACE_BLOCK_TOKENS,
    ReplayConfig,
    TraceRequest,
    arrival,
    held_cache,
    infinite_hit_rate,
    load_trace,
    trace_request,
)
from prefixcache.config import DTYPES
from prefixcache.core import KVCacheManager, hittable_blocks
from prefixcache.engine.args import config_default
from prefixcache.replay import CostModel
from prefixcache.router.index import IndexListener, PrefixIndex
from prefixcache.router.policy import (
    DEFAULT_AFFINITY_BALANCE,
    DEFAULT_PREFIX_WEIGHT,
    POLICIES,
    Candidate,
    RoutingPolicy,
    make_policy,
)
from prefixcache.router.wire import external_block_hash

SINGLE = "single"


@dataclass(frozen=True, slots=True)
class SimResult:
    """One policy's replay. ``policy`` is a routing policy, or ``single``: one engine of N times the capacity."""

    policy: str
    engines: int
    capacity_tokens: int
    hit_rate: float
    infinite_hit_rate: float
    requests: list[int]
    computed_tokens: list[int]
    predicted_cached_tokens: int
    cached_tokens: int

    @property
    def request_imbalance(self) -> float:
        """Most requests on one engine over the mean (1 is perfectly even)."""
        return max(self.requests) * len(self.requests) / sum(self.requests)

    @property
    def compute_imbalance(self) -> float:
        """Most prompt tokens computed by one engine over the mean."""
        total = sum(self.computed_tokens)
        return max(self.computed_tokens) * len(self.computed_tokens) / total if total else 1.0

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "request_imbalance": self.request_imbalance,
            "compute_imbalance": self.compute_imbalance,
        }


def simulate(
    trace: Sequence[TraceRequest],
    num_engines: int,
    capacity_blocks: int,
    policy: RoutingPolicy,
    config: ReplayConfig,
    progress: bool = False,
) -> SimResult:
    """Route every request of ``trace`` to one of ``num_engines`` caches of ``capacity_blocks`` with ``policy``."""
    index = PrefixIndex()
    names = [f"engine-{i}" for i in range(num_engines)]
    caches = []
    for name in names:
        manager = KVCacheManager(
            num_blocks=capacity_blocks,
            block_size=config.block_size,
            hash_algo=config.hash_algo,
            listeners=[IndexListener(index, name)],
        )
        caches.append(held_cache(manager, config))
    block_size = config.block_size
    requests = [0] * num_engines
    computed = [0] * num_engines
    predicted_total = cached_total = queries = 0
    desc = f"{policy.name} x{num_engines}"
    for i, record in enumerate(tqdm(trace, desc=desc, unit="req", disable=not progress, leave=False)):
        now = arrival(i, record, config)
        for cache in caches:
            cache.advance(now)
        request = trace_request(i, record)
        matched = dict.fromkeys(names, 0)
        if policy.uses_prefix:
            hittable = hittable_blocks(record.input_length, block_size)
            hashes = caches[0].manager.block_hashes(request)[:hittable]
            matched = index.matched_blocks([external_block_hash(h) for h in hashes], names)
        candidates = [
            Candidate(name, record.input_length, matched[name] * block_size, c.tokens_in_flight, c.num_in_flight)
            for name, c in zip(names, caches, strict=True)
        ]
        chosen = policy.choose(candidates)
        target = names.index(chosen.name)
        num_cached = caches[target].admit(i, request, record.output_length)
        requests[target] += 1
        computed[target] += record.input_length - num_cached
        predicted_total += chosen.cached_tokens
        cached_total += num_cached
        queries += record.input_length
    for cache in caches:
        cache.drain()
    return SimResult(
        policy=policy.name,
        engines=num_engines,
        capacity_tokens=capacity_blocks * block_size,
        hit_rate=cached_total / queries if queries else 0.0,
        infinite_hit_rate=infinite_hit_rate(trace, block_size),
        requests=requests,
        computed_tokens=computed,
        predicted_cached_tokens=predicted_total,
        cached_tokens=cached_total,
    )


def simulate_single(
    trace: Sequence[TraceRequest], num_engines: int, capacity_blocks: int, config: ReplayConfig, progress: bool
) -> SimResult:
    """The reference: one engine with ``num_engines`` times the capacity serves everything."""
    result = simulate(trace, 1, num_engines * capacity_blocks, make_policy("round_robin"), config, progress)
    return SimResult(**{**asdict(result), "policy": SINGLE})


def format_sim_table(results: Sequence[SimResult]) -> str:
    single = next((r for r in results if r.policy == SINGLE), None)
    lines = [
        f"{'policy':<12}{'engines':>8}{'hit rate':>10}{'vs single':>10}{'req max/mean':>14}"
        f"{'compute max/mean':>18}  requests per engine"
    ]
    for r in results:
        ratio = f"{r.hit_rate / single.hit_rate:>10.3f}" if single and single.hit_rate else f"{'-':>10}"
        lines.append(
            f"{r.policy:<12}{r.engines:>8}{r.hit_rate:>10.4f}{ratio}{r.request_imbalance:>14.3f}"
            f"{r.compute_imbalance:>18.3f}  {r.requests}"
        )
    lines.append(f"infinite-capacity hit rate: {results[0].infinite_hit_rate:.4f}")
    return "\n".join(lines)


def plot_sim(results: Sequence[SimResult], path: Path, title: str) -> None:
    """Hit rate per policy (single engine dashed) and requests per engine per policy."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    routed = [r for r in results if r.policy != SINGLE]
    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    hits, loads = fig.subplots(1, 2)
    hits.bar([r.policy for r in routed], [r.hit_rate for r in routed], color="tab:blue")
    engines = routed[0].engines if routed else 1
    for r in results:
        if r.policy == SINGLE:
            hits.axhline(r.hit_rate, linestyle="--", color="black", label=f"one engine, {engines}x capacity")
    hits.axhline(results[0].infinite_hit_rate, linestyle=":", color="gray", label="infinite capacity")
    hits.set_ylabel("prompt token hit rate")
    hits.set_title(f"hit rate, {engines} engines")
    hits.legend()
    width = 0.8 / max(1, len(routed))
    for k, r in enumerate(routed):
        xs = [e + k * width for e in range(r.engines)]
        loads.bar(xs, r.requests, width=width, label=r.policy)
    loads.set_xticks([e + width * (len(routed) - 1) / 2 for e in range(engines)], [str(e) for e in range(engines)])
    loads.set_xlabel("engine")
    loads.set_ylabel("requests")
    loads.set_title("requests per engine")
    loads.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _run_sim(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[SimResult]:
    if TRACE_BLOCK_TOKENS % args.block_size:
        parser.error(f"--block-size must divide {TRACE_BLOCK_TOKENS}, got {args.block_size}")
    capacity_blocks = args.capacity_tokens // args.block_size
    if capacity_blocks == 0:
        parser.error(f"--capacity-tokens must hold at least one {args.block_size}-token block")
    config = ReplayConfig(
        block_size=args.block_size,
        hash_algo=args.hash_algo,
        cost=CostModel(args.prefill_ms_per_token, args.decode_ms_per_token),
    )
    try:
        trace = load_trace(args.trace, args.max_requests)
    except (OSError, ValueError) as exc:
        parser.error(f"{args.trace}: {exc}")
    if not trace:
        parser.error(f"{args.trace} holds no requests")
    print(
        f"{args.trace.name}: {len(trace):,} requests; {args.engines} engines of {capacity_blocks * args.block_size:,} "
        f"tokens ({args.block_size}-token blocks) vs one of {args.engines * capacity_blocks * args.block_size:,}; "
        f"prefix weight {args.prefix_weight}"
    )
    progress = len(trace) >= 1000
    try:
        results = [simulate_single(trace, args.engines, capacity_blocks, config, progress)]
        for name in args.policy:
            policy = make_policy(name, args.prefix_weight)
            results.append(simulate(trace, args.engines, capacity_blocks, policy, config, progress))
    except ValueError as exc:  # a request larger than one engine's cache
        parser.error(str(exc))
    print(format_sim_table(results))
    if args.json is not None:
        args.json.write_text(json.dumps([r.to_json() for r in results], indent=2) + "\n")
    if args.plot is not None:
        plot_sim(results, args.plot, args.trace.name)
    return results


def _policy_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(POLICIES)}")
    return names


def _add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    parser.add_argument("--engines", type=positive_int, default=4, help="number of engines (default 4)")
    parser.add_argument("--capacity-tokens", type=positive_int, default=1_000_000, help="cache size of each engine")
    parser.add_argument("--policy", type=_policy_list, default=list(POLICIES), help="comma-separated policies")
    parser.add_argument("--prefix-weight", type=float, default=DEFAULT_PREFIX_WEIGHT, help="the prefix cost weight")
    parser.add_argument("--block-size", type=positive_int, default=TRACE_BLOCK_TOKENS, help="must divide 512")
    parser.add_argument("--max-requests", type=positive_int, help="replay only the first N requests")
    default_cost = CostModel()
    parser.add_argument("--prefill-ms-per-token", type=float, default=default_cost.prefill_ms_per_token)
    parser.add_argument("--decode-ms-per-token", type=float, default=default_cost.decode_ms_per_token)
    parser.add_argument("--hash-algo", default="sha256")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG of hit rate and requests per engine here")


def _add_live_arguments(parser: argparse.ArgumentParser) -> None:
    from prefixcache.bench.route_live import BACKEND_KINDS, VLLM_SERVE_ENV, WORKLOADS

    parser.add_argument("--model", help="HF checkpoint dir or .gguf for every engine (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--engines", type=positive_int, default=2)
    parser.add_argument("--backend-kind", choices=BACKEND_KINDS, default="prefixcache", help="what the backends run")
    parser.add_argument(
        "--vllm-serve",
        default=os.environ.get(VLLM_SERVE_ENV),
        metavar="SCRIPT",
        help=f"starts vLLM's OpenAI server as SCRIPT MODEL_DIR PORT DTYPE [vLLM flags] (default ${VLLM_SERVE_ENV})",
    )
    parser.add_argument(
        "--compare-peers",
        action="store_true",
        help="also run vllm-router (kv_aware, cache_aware) and sglang-router (cache_aware), installed on first use "
        "into venvs under the cache dir",
    )
    parser.add_argument("--workload", choices=WORKLOADS, default="tenants")
    parser.add_argument("--replicas", type=positive_int, help="processes per router, requests dealt in turn "
                        "(default: 2 for the fleet workload, else 1)")  # fmt: skip
    parser.add_argument("--tenants", type=positive_int, default=8)
    parser.add_argument("--system-len", type=positive_int, default=1024, help="tokens of each tenant's system prompt")
    parser.add_argument("--user-len", type=positive_int, default=32, help="own tokens of each request or turn")
    parser.add_argument("--output-len", type=positive_int, default=8)
    parser.add_argument("--turns", type=positive_int, help="turns per conversation (fleet; default 3)")
    parser.add_argument("--phases", type=positive_int, default=4, help="popularity phases (fleet)")
    parser.add_argument("--think-time", type=float, default=1.0, help="seconds between a conversation's turns")
    parser.add_argument("--backend-offload-cpu", metavar="SIZE", help="a host tier on each prefixcache backend")
    parser.add_argument("--num-requests", type=positive_int, default=64)
    parser.add_argument("--request-rate", type=float, default=1.0, help="requests/s, Poisson")
    parser.add_argument("--block-size", type=positive_int, help="default 16 (vLLM backends: 32)")
    parser.add_argument("--num-blocks", type=positive_int, help="KV blocks per engine (default: share + 1 tenant)")
    parser.add_argument(
        "--dtype", default=config_default("dtype"), choices=DTYPES, help="as prefixcache serve --dtype (both kinds)"
    )
    parser.add_argument("--policy", type=_policy_list, default=list(POLICIES), help="comma-separated policies")
    parser.add_argument("--prefix-weight", type=float, default=DEFAULT_PREFIX_WEIGHT, help="the prefix cost weight")
    parser.add_argument("--affinity-balance", type=float, default=DEFAULT_AFFINITY_BALANCE, help="ours' affinity bound")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a process to come up")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG of hit rate and TTFT per router here")


def _run_live(args: argparse.Namespace) -> list[dict]:
    from prefixcache.bench.route_live import run_live

    return run_live(args)


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``route sim`` and ``route live`` to the ``prefixcache bench`` subcommands."""
    route = bench_subparsers.add_parser("route", help="routing policies over several engines", description=__doc__)
    modes = route.add_subparsers(dest="mode", required=True)
    sim = modes.add_parser("sim", help="simulate N engines on a Mooncake trace", description=__doc__)
    _add_sim_arguments(sim)
    sim.set_defaults(func=lambda args: _run_sim(sim, args))
    live = modes.add_parser("live", help="N serve processes and the router on loopback", description=__doc__)
    _add_live_arguments(live)
    live.set_defaults(func=_run_live)


def main(argv: list[str] | None = None) -> list:
    """``prefixcache bench route ...`` on its own (``argv`` starts with ``sim`` or ``live``)."""
    parser = argparse.ArgumentParser(prog="prefixcache bench")
    register(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args(["route", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
