"""``prefixcache bench trace``: replay a request trace through the real KVCacheManager at a fixed capacity.

Input is the Mooncake trace format, one JSON object per line: ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids``, prefix-chained ids of 512-token blocks (the last may be partial).
Each id becomes a deterministic synthetic token block, so the manager hashes and looks up real tokens.

Requests are admitted in arrival order and hold their blocks (prompt plus room for the output) while
in flight: for ``prefill_ms_per_token * uncached input tokens + decode_ms_per_token * output tokens``
after they start, or, with ``in_flight=N``, until N later requests have been admitted. A request that
does not fit waits (and so does everything behind it) until enough in-flight requests finish.

The token hit rate (prompt tokens found cached / prompt tokens) is reported next to two references
from the same trace: infinite capacity, which no policy can beat, and Belady's offline rule (evict the
free block whose next lookup is farthest in the future), replayed through the same manager with the
same holding. See docs/eviction.md for the exact definitions.

With ``--retention-rule shared`` each policy also runs with the engine's retention rule (blocks more than one
request reached are kept at a raised priority for a while; ``prefixcache.core.retention_rules``), through the
real pool's priorities and TTLs on the replay's clock. Every row prints the share of the gap between LRU and
Belady it closes.

With ``--offload-tokens N`` each policy also runs with a host memory tier of N tokens behind the device
cache: the real offload connector and host store, with a placeholder payload per block, saving
write-through or write-back (``--offload-mode``). Its hit rate counts device and tier hits together.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import heapq
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from prefixcache.argtypes import positive_int
from prefixcache.core import (
    EVICTION_POLICIES,
    HASH_ALGOS,
    Block,
    BlockHash,
    KVCacheManager,
    Request,
    hittable_blocks,
)
from prefixcache.core.hashing import root_hash
from prefixcache.core.retention_rules import RETENTION_RULES
from prefixcache.offload import HostMemoryStore, KVLayout
from prefixcache.offload.connector import OFFLOAD_MODES, WRITE_BACK, OffloadConnector, OffloadPlan, TierWriter
from prefixcache.replay import CostModel, HeldCache, ReplayClock

TRACE_BLOCK_TOKENS = 512
# Token t of the block with id k is (512 k + t) * _MIX mod 2**32: odd, so a bijection on uint32, and ids
# below 2**23 keep 512 k + t below 2**32; distinct ids therefore never produce the same block.
_MIX = 0x9E3779B1
MAX_HASH_ID = 2**32 // TRACE_BLOCK_TOKENS - 1
NEVER = math.inf
BELADY = "belady"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_trace_line(line: str) -> TraceRequest:
    """One Mooncake record, checked: a malformed trace would silently skew every hit rate."""
    record = json.loads(line)
    request = TraceRequest(
        timestamp_ms=float(record["timestamp"]),
        input_length=int(record["input_length"]),
        output_length=int(record["output_length"]),
        hash_ids=tuple(int(k) for k in record["hash_ids"]),
    )
    if request.input_length <= 0 or request.output_length < 0:
        raise ValueError(f"input_length must be positive and output_length >= 0: {line.strip()}")
    if len(request.hash_ids) != -(-request.input_length // TRACE_BLOCK_TOKENS):
        raise ValueError(
            f"{len(request.hash_ids)} hash_ids for {request.input_length} tokens; expected one per "
            f"{TRACE_BLOCK_TOKENS}-token block"
        )
    if not all(0 <= k <= MAX_HASH_ID for k in request.hash_ids):
        raise ValueError(f"hash_ids must be in [0, {MAX_HASH_ID}]")
    return request


def load_trace(path: Path, max_requests: int | None = None) -> list[TraceRequest]:
    """The first ``max_requests`` records of a JSONL trace, in arrival order (stable for equal timestamps)."""
    requests: list[TraceRequest] = []
    with open(path) as f:
        for line in f:
            if max_requests is not None and len(requests) >= max_requests:
                break
            if line.strip():
                requests.append(parse_trace_line(line))
    _check_chained(requests)
    requests.sort(key=lambda r: r.timestamp_ms)
    return requests


def _check_chained(requests: Sequence[TraceRequest]) -> None:
    """Every id must always follow the same parent: the references key blocks by id, the manager by prefix."""
    parent_of: dict[int, int | None] = {}
    for request in requests:
        parent = None
        for k in request.hash_ids:
            if parent_of.setdefault(k, parent) != parent:
                raise ValueError(f"hash id {k} follows both {parent_of[k]} and {parent}; ids must be prefix-chained")
            parent = k


def synthetic_tokens(hash_ids: Sequence[int], num_tokens: int) -> list[int]:
    """The prompt for a trace record: block ``k`` is a fixed token sequence derived from ``k`` alone.

    Ids are prefix-chained, so equal ids at a position mean equal prefixes; equal ids give equal tokens
    and different ids different tokens, and the manager's chained hashes agree with the trace's ids.
    """
    ids = np.asarray(hash_ids, dtype=np.uint64)
    positions = ids[:, None] * np.uint64(TRACE_BLOCK_TOKENS) + np.arange(TRACE_BLOCK_TOKENS, dtype=np.uint64)
    return ((positions.ravel()[:num_tokens] * np.uint64(_MIX)) & np.uint64(0xFFFFFFFF)).tolist()


def _sub_blocks_per_trace_block(block_size: int) -> int:
    if block_size <= 0 or TRACE_BLOCK_TOKENS % block_size:
        raise ValueError(f"block_size must divide {TRACE_BLOCK_TOKENS}, got {block_size}")
    return TRACE_BLOCK_TOKENS // block_size


def _trace_block_coverage(num_blocks: int, position: int, per_trace_block: int) -> int:
    """How many of the manager blocks inside the trace block at ``position`` lie within ``num_blocks``."""
    return min(max(num_blocks - position * per_trace_block, 0), per_trace_block)


def infinite_hit_rate(trace: Sequence[TraceRequest], block_size: int) -> float:
    """The token hit rate with unlimited capacity: the longest prefix of blocks any earlier request filled."""
    per = _sub_blocks_per_trace_block(block_size)
    filled: dict[int, int] = {}  # trace id -> how many of its manager blocks some request filled
    hits = queries = 0
    for request in trace:
        hittable = hittable_blocks(request.input_length, block_size)
        full = request.input_length // block_size
        hit = 0
        for position, k in enumerate(request.hash_ids):
            found = min(filled.get(k, 0), _trace_block_coverage(hittable, position, per))
            hit += found
            if found < per:
                break
        for position, k in enumerate(request.hash_ids):
            filled[k] = max(filled.get(k, 0), _trace_block_coverage(full, position, per))
        hits += hit * block_size
        queries += request.input_length
    return hits / queries if queries else 0.0


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """``in_flight=N`` holds each request until N later ones are admitted, instead of the cost model.

    ``max_retained_fraction`` bounds the blocks a retention rule keeps above the default priority (the engine's
    ``--max-retained-fraction``); in a replay the rule is the only source of them, so it may take the whole cache.
    """

    block_size: int = TRACE_BLOCK_TOKENS
    hash_algo: str = "sha256"
    cost: CostModel = field(default_factory=CostModel)
    in_flight: int | None = None
    offload_blocks: int = 0
    offload_mode: str = WRITE_BACK
    max_retained_fraction: float = 1.0

    def __post_init__(self) -> None:
        _sub_blocks_per_trace_block(self.block_size)
        if not 0.0 <= self.max_retained_fraction <= 1.0:
            raise ValueError(f"max_retained_fraction must be in [0, 1], got {self.max_retained_fraction}")
        if self.in_flight is not None and self.in_flight <= 0:
            raise ValueError(f"in_flight must be positive, got {self.in_flight}")
        if self.offload_blocks < 0:
            raise ValueError(f"offload_blocks must be >= 0, got {self.offload_blocks}")
        if self.offload_mode not in OFFLOAD_MODES:
            raise ValueError(f"offload_mode must be one of {', '.join(OFFLOAD_MODES)}, got {self.offload_mode!r}")


class FutureUses:
    """For every trace block, the requests that will look it up, in order: Belady's view of the future."""

    def __init__(self, trace: Sequence[TraceRequest], block_size: int) -> None:
        per = _sub_blocks_per_trace_block(block_size)
        self._uses: dict[int, list[tuple[int, int]]] = {}  # id -> [(request index, hittable blocks of it)]
        for index, request in enumerate(trace):
            hittable = hittable_blocks(request.input_length, block_size)
            for position, k in enumerate(request.hash_ids):
                covered = _trace_block_coverage(hittable, position, per)
                if covered == 0:
                    break
                self._uses.setdefault(k, []).append((index, covered))
        self._cursor = dict.fromkeys(self._uses, 0)

    def next_use(self, trace_id: int, sub_block: int, now: int) -> float:
        """The first request at or after ``now`` whose lookup may return that block; ``now`` never decreases."""
        uses = self._uses.get(trace_id)
        if uses is None:
            return NEVER
        i = self._cursor[trace_id]
        while i < len(uses) and uses[i][0] < now:
            i += 1
        self._cursor[trace_id] = i
        for index, covered in uses[i:]:
            if covered > sub_block:
                return index
        return NEVER


class BeladyPolicy:
    """The offline reference: evict the free block whose next lookup is farthest away, the deepest on ties.

    Any request that can hit a block also looks up its parent first, so a parent's next use is never
    later than its child's; with deepest-first ties a free parent never goes before its free child and
    no cached block is stranded behind an evicted prefix. A max-heap with lazy deletion holds the keys;
    ``start_request`` advances the clock and re-keys free blocks the previous request passed over.
    """

    def __init__(self, future: FutureUses, block_size: int) -> None:
        self._future = future
        self._per = _sub_blocks_per_trace_block(block_size)
        self._now = 0
        self._where: dict[BlockHash, tuple[int, int, int]] = {}  # hash -> (trace id, sub-block, depth)
        self._queued: dict[int, tuple[tuple[float, int, int], Block]] = {}  # block id -> (heap entry, block)
        self._by_hash: dict[BlockHash, dict[int, Block]] = {}
        self._heap: list[tuple[float, int, int]] = []
        self._last_hashes: Sequence[BlockHash] = ()

    def start_request(self, index: int, request: TraceRequest, hashes: Sequence[BlockHash]) -> None:
        self._now = index
        for block_hash in self._last_hashes:
            for block in self._by_hash.get(block_hash, {}).values():
                self._enqueue(block)
        for depth, block_hash in enumerate(hashes):
            position, sub_block = divmod(depth, self._per)
            self._where[block_hash] = (request.hash_ids[position], sub_block, depth)
        self._last_hashes = hashes

    def _enqueue(self, block: Block) -> None:
        trace_id, sub_block, depth = self._where[block.block_hash]
        entry = (-self._future.next_use(trace_id, sub_block, self._now), -depth, block.block_id)
        self._queued[block.block_id] = (entry, block)
        heapq.heappush(self._heap, entry)

    def push(self, block: Block) -> None:
        self._by_hash.setdefault(block.block_hash, {})[block.block_id] = block
        self._enqueue(block)

    def pop(self) -> Block:
        while True:
            entry = heapq.heappop(self._heap)
            queued = self._queued.get(entry[2])
            if queued is not None and queued[0] == entry:
                block = queued[1]
                self.remove(block)
                return block

    def remove(self, block: Block) -> None:
        del self._queued[block.block_id]
        same_hash = self._by_hash[block.block_hash]
        del same_hash[block.block_id]
        if not same_hash:
            del self._by_hash[block.block_hash]

    def clear(self) -> None:
        self._queued.clear()
        self._by_hash.clear()
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._queued)

    def __iter__(self) -> Iterator[Block]:
        return (block for _, block in self._queued.values())


def replay(
    trace: Sequence[TraceRequest],
    capacity_blocks: int,
    policy: str,
    config: ReplayConfig = ReplayConfig(),
    progress: bool = False,
    retention_rule: str | None = None,
) -> float:
    """The token hit rate of the trace through a ``capacity_blocks`` manager evicting with ``policy``.

    ``policy`` is a name from EVICTION_POLICIES, or BELADY for the offline reference. With
    ``config.offload_blocks`` a host tier sits behind the manager and its hits count too. ``retention_rule`` (a
    name from RETENTION_RULES) runs in the manager, its TTLs timed by the replay's clock (the cost model's: a
    clock that counts admissions, ``in_flight``, has no seconds).
    """
    if retention_rule is not None and config.in_flight:
        raise ValueError("a retention rule's TTLs need the cost model's clock, not in_flight")
    eviction_policy: str | BeladyPolicy = policy
    on_request = None
    if policy == BELADY:
        eviction_policy = BeladyPolicy(FutureUses(trace, config.block_size), config.block_size)
        on_request = eviction_policy.start_request
    connector = simulated_host_tier(config) if config.offload_blocks else None
    clock = ReplayClock()
    manager = KVCacheManager(
        num_blocks=capacity_blocks,
        block_size=config.block_size,
        hash_algo=config.hash_algo,
        eviction_policy=eviction_policy,
        connector=connector,
        max_retained_fraction=config.max_retained_fraction,
        clock=clock,
        retention_rule=retention_rule,
    )
    rule = f" + {retention_rule}" if retention_rule else ""
    desc = f"{policy}{rule} @ {capacity_blocks * config.block_size:,} tokens"
    drive(manager, trace, config, on_request, progress, desc, clock)
    return manager.stats.hit_rate


def arrival(index: int, record: TraceRequest, config: ReplayConfig) -> float:
    """A request's arrival on the replay clock: its timestamp, or its index when holding by admissions."""
    return float(index) if config.in_flight else record.timestamp_ms


def trace_request(index: int, record: TraceRequest) -> Request:
    return Request(str(index), synthetic_tokens(record.hash_ids, record.input_length))


def simulated_host_tier(config: ReplayConfig) -> OffloadConnector:
    """The real connector and host store with ``config.offload_blocks`` blocks of a one-value layout."""
    layout = KVLayout(
        "trace-simulation", "float16", config.block_size, 1, 1, 1, config.hash_algo, root_hash(config.hash_algo)
    )
    store = HostMemoryStore(layout, config.offload_blocks * layout.block_bytes)
    writer = TierWriter([store], background=False)
    return OffloadConnector([store], config.block_size, config.offload_mode, writer)


def held_cache(manager: KVCacheManager, config: ReplayConfig) -> HeldCache:
    """A :class:`~prefixcache.replay.HeldCache` holding requests as ``config`` says; with a simulated host tier
    behind ``manager``, every block its plans save is stored with a placeholder payload (the worker's part)."""
    connector = manager.connector
    on_transfers = None
    if isinstance(connector, OffloadConnector):
        placeholder = bytes(connector.stores[0].layout.block_bytes)

        def on_transfers(plan: OffloadPlan) -> None:
            for save in plan.save_before + plan.save_after:
                connector.writer.submit(save.tiers, [(save.block_hash, placeholder)])

    return HeldCache(manager, config.cost, config.in_flight, on_transfers)


def drive(
    manager: KVCacheManager,
    trace: Sequence[TraceRequest],
    config: ReplayConfig,
    on_request: Callable[[int, TraceRequest, Sequence[BlockHash]], None] | None = None,
    progress: bool = False,
    desc: str = "",
    clock: ReplayClock | None = None,
) -> None:
    """Admit each request in order, freeing in-flight ones as their time comes or when room is needed.

    With ``in_flight`` the clock counts admissions instead of milliseconds. ``on_request`` sees each
    request's index, record and block hashes before its lookup. With a connector behind the manager the
    lookup is extended by its tiers, and tokens loaded from them cost nothing, like cached ones. ``clock``, the
    manager's, follows the replay's.
    """
    cache = held_cache(manager, config)
    if clock is not None:
        clock.follow(cache)
    for index, record in enumerate(tqdm(trace, desc=desc, unit="req", disable=not progress, leave=False)):
        cache.advance(arrival(index, record, config))
        request = trace_request(index, record)
        if on_request is not None:
            on_request(index, record, manager.block_hashes(request))
        cache.admit(index, request, record.output_length)
    cache.drain()


@dataclass(frozen=True, slots=True)
class TraceResult:
    """``offload_tokens`` > 0: a host tier of that size (filled ``offload_mode``) sat behind the device cache;
    the hit rate counts both, the references (LRU's, Belady's) are the device cache's alone. ``retention_rule``:
    the policy ran with that rule."""

    policy: str
    capacity_tokens: int
    hit_rate: float
    belady_hit_rate: float
    infinite_hit_rate: float
    lru_hit_rate: float
    offload_tokens: int = 0
    offload_mode: str | None = None
    retention_rule: str | None = None

    @property
    def label(self) -> str:
        label = self.policy if self.retention_rule is None else f"{self.policy} + {self.retention_rule} retention"
        if not self.offload_tokens:
            return label
        return f"{label} + {self.offload_tokens:,}-token host tier ({self.offload_mode.replace('_', '-')})"

    @property
    def gap_closed(self) -> float | None:
        """The share of the gap between LRU and Belady this run closes (None when Belady is no better than LRU)."""
        gap = self.belady_hit_rate - self.lru_hit_rate
        return (self.hit_rate - self.lru_hit_rate) / gap if gap > 0 else None


def sweep(
    trace: Sequence[TraceRequest],
    capacities_blocks: Sequence[int],
    policies: Sequence[str],
    config: ReplayConfig = ReplayConfig(),
    progress: bool = False,
    offload_modes: Sequence[str] | None = None,
    retention_rules: Sequence[str] = (),
) -> list[TraceResult]:
    """Every policy at every capacity, with the LRU and Belady references per capacity and the infinite one.

    Each policy also runs with each of ``retention_rules`` (device only). With ``config.offload_blocks`` every
    policy also runs with the host tier, once per mode in ``offload_modes`` (default: ``config.offload_mode``).
    """
    infinite = infinite_hit_rate(trace, config.block_size)
    device_only = dataclasses.replace(config, offload_blocks=0)
    offload_tokens = config.offload_blocks * config.block_size
    results = []
    for capacity in capacities_blocks:
        belady = replay(trace, capacity, BELADY, device_only, progress)
        capacity_tokens = capacity * config.block_size
        device = {policy: replay(trace, capacity, policy, device_only, progress) for policy in policies}
        lru = device["lru"] if "lru" in device else replay(trace, capacity, "lru", device_only, progress)
        for policy, hit_rate in device.items():
            results.append(TraceResult(policy, capacity_tokens, hit_rate, belady, infinite, lru))
            for rule in retention_rules:
                hit_rate = replay(trace, capacity, policy, device_only, progress, rule)
                results.append(
                    TraceResult(policy, capacity_tokens, hit_rate, belady, infinite, lru, retention_rule=rule)
                )
            for mode in (offload_modes or [config.offload_mode]) if config.offload_blocks else ():
                tiered = dataclasses.replace(config, offload_mode=mode)
                hit_rate = replay(trace, capacity, policy, tiered, progress)
                results.append(
                    TraceResult(policy, capacity_tokens, hit_rate, belady, infinite, lru, offload_tokens, mode)
                )
    return results


def format_table(results: Sequence[TraceResult]) -> str:
    """One row a run; ``gap closed``: the share of the LRU-Belady gap at its capacity (``-`` without a gap)."""
    width = max(8, *(len(r.label) + 2 for r in results))
    header = f"{'capacity (tokens)':>18}  {'policy':<{width}}{'hit rate':>10}{'belady':>10}{'infinite':>10}"
    lines = [f"{header}{'gap closed':>12}"]
    for r in results:
        closed = "-" if r.gap_closed is None else f"{r.gap_closed:.1%}"
        lines.append(
            f"{r.capacity_tokens:>18,}  {r.label:<{width}}{r.hit_rate:>10.4f}{r.belady_hit_rate:>10.4f}"
            f"{r.infinite_hit_rate:>10.4f}{closed:>12}"
        )
    return "\n".join(lines)


def write_plot(results: Sequence[TraceResult], path: Path, title: str) -> None:
    """Hit rate against (device) capacity: one line per policy and tier, Belady dashed, infinite dotted."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label in dict.fromkeys(r.label for r in results):
        points = sorted((r.capacity_tokens / 1e6, r.hit_rate) for r in results if r.label == label)
        ax.plot(*zip(*points, strict=True), marker="o", label=label)
    belady = sorted({(r.capacity_tokens / 1e6, r.belady_hit_rate) for r in results})
    ax.plot(*zip(*belady, strict=True), linestyle="--", color="black", label="belady (offline)")
    ax.axhline(results[0].infinite_hit_rate, linestyle=":", color="gray", label="infinite capacity")
    ax.set_xlabel("device cache capacity (million tokens)")
    ax.set_ylabel("prompt token hit rate")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _int_list(text: str) -> list[int]:
    values = [positive_int(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return values


def _name_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, help="Mooncake-format JSONL trace")
    parser.add_argument("--list-policies", action="store_true", help="print the eviction policies and exit")
    capacity = parser.add_mutually_exclusive_group()
    capacity.add_argument("--capacity-tokens", type=positive_int, help="cache size in tokens (default 1,000,000)")
    capacity.add_argument("--capacity-blocks", type=positive_int, help="cache size in blocks")
    capacity.add_argument("--capacities", type=_int_list, help="sweep: comma-separated cache sizes in tokens")
    parser.add_argument("--policy", type=_name_list, default=["lru"], help="comma-separated policies (default lru)")
    parser.add_argument("--block-size", type=positive_int, default=TRACE_BLOCK_TOKENS, help="must divide 512")
    parser.add_argument("--max-requests", type=positive_int, help="replay only the first N requests")
    parser.add_argument("--in-flight", type=positive_int, help="hold exactly N requests, not the cost model")
    default_cost = CostModel()
    parser.add_argument("--prefill-ms-per-token", type=float, default=default_cost.prefill_ms_per_token)
    parser.add_argument("--decode-ms-per-token", type=float, default=default_cost.decode_ms_per_token)
    parser.add_argument("--hash-algo", choices=HASH_ALGOS, default="sha256")
    parser.add_argument(
        "--offload-tokens", type=positive_int, help="also run each policy with a host tier of N tokens behind it"
    )
    parser.add_argument(
        "--offload-mode",
        type=_name_list,
        default=[WRITE_BACK],
        help=f"comma-separated ways to fill the host tier: {', '.join(OFFLOAD_MODES)} (default {WRITE_BACK})",
    )
    parser.add_argument(
        "--retention-rule",
        type=_name_list,
        default=[],
        help=f"comma-separated retention rules each policy also runs with: {', '.join(RETENTION_RULES)} (default none)",
    )
    parser.add_argument(
        "--max-retained-fraction",
        type=float,
        default=1.0,
        help="share of the cache a retention rule may keep above the default priority (default 1.0)",
    )
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG of hit rate against capacity here")


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``trace`` to the ``prefixcache bench`` subcommands."""
    parser = bench_subparsers.add_parser(
        "trace", help="eviction policies against Belady on a request trace", description=__doc__
    )
    add_arguments(parser)
    parser.set_defaults(func=functools.partial(run, parser))


def main(argv: list[str] | None = None) -> list[TraceResult]:
    parser = argparse.ArgumentParser(prog="prefixcache bench trace", description=__doc__)
    add_arguments(parser)
    return run(parser, parser.parse_args(argv))


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[TraceResult]:
    """The command: validate, replay, print the table, write JSON and plot."""
    if args.list_policies:
        print("\n".join(EVICTION_POLICIES))
        return []
    if args.trace is None:
        parser.error("--trace is required")
    unknown = [p for p in args.policy if p not in EVICTION_POLICIES]
    if unknown:
        parser.error(f"unknown policy {', '.join(unknown)}; choose from {', '.join(EVICTION_POLICIES)}")
    if TRACE_BLOCK_TOKENS % args.block_size:
        parser.error(f"--block-size must divide {TRACE_BLOCK_TOKENS}, got {args.block_size}")
    unknown = [r for r in args.retention_rule if r not in RETENTION_RULES]
    if unknown:
        parser.error(f"unknown retention rule {', '.join(unknown)}; choose from {', '.join(RETENTION_RULES)}")
    if args.retention_rule and args.in_flight:
        parser.error("--retention-rule needs the cost model's clock for its TTLs, not --in-flight")
    if not 0.0 <= args.max_retained_fraction <= 1.0:
        parser.error(f"--max-retained-fraction must be in [0, 1], got {args.max_retained_fraction}")
    unknown = [m for m in args.offload_mode if m not in OFFLOAD_MODES]
    if unknown:
        parser.error(f"unknown offload mode {', '.join(unknown)}; choose from {', '.join(OFFLOAD_MODES)}")
    offload_blocks = (args.offload_tokens or 0) // args.block_size
    if args.offload_tokens and not offload_blocks:
        parser.error(f"--offload-tokens must hold at least one {args.block_size}-token block")
    if args.capacity_blocks is not None:
        capacities = [args.capacity_blocks]
    else:
        capacities = sorted({t // args.block_size for t in args.capacities or [args.capacity_tokens or 1_000_000]})
    if min(capacities) == 0:
        parser.error(f"every capacity must hold at least one {args.block_size}-token block")
    config = ReplayConfig(
        block_size=args.block_size,
        hash_algo=args.hash_algo,
        cost=CostModel(args.prefill_ms_per_token, args.decode_ms_per_token),
        in_flight=args.in_flight,
        offload_blocks=offload_blocks,
        max_retained_fraction=args.max_retained_fraction,
    )
    try:
        trace = load_trace(args.trace, args.max_requests)
    except (OSError, ValueError) as exc:
        parser.error(f"{args.trace}: {exc}")
    if not trace:
        parser.error(f"{args.trace} holds no requests")
    holding = (
        f"{config.in_flight} requests in flight"
        if config.in_flight
        else f"prefill {config.cost.prefill_ms_per_token} ms/token + decode {config.cost.decode_ms_per_token} ms/token"
    )
    print(
        f"{args.trace.name}: {len(trace):,} requests, "
        f"{sum(r.input_length for r in trace) / len(trace):,.0f} prompt tokens on average; "
        f"blocks of {config.block_size} tokens; held for {holding}"
        + (f"; retention rules may keep {config.max_retained_fraction:.0%} of the cache" if args.retention_rule else "")
    )
    try:
        results = sweep(
            trace, capacities, args.policy, config, len(trace) >= 1000, args.offload_mode, args.retention_rule
        )
    except ValueError as exc:  # a request larger than the cache
        parser.error(str(exc))
    print(format_table(results))
    if args.json is not None:
        records = [asdict(r) for r in results]
        args.json.write_text(json.dumps(records[0] if len(records) == 1 else records, indent=2) + "\n")
    if args.plot is not None:
        write_plot(results, args.plot, args.trace.name)
    return results


if __name__ == "__main__":
    main()
