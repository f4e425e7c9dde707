"""The prefix-caching KV cache manager: the one owner of prefix admission and of every request's block tables.

A request is admitted in two calls every caller makes (the scheduler, the trace replays, the tests):
:meth:`KVCacheManager.find_prefix` finds what it can reuse (blocks every KV cache group holds, a sub-block
copy, whole blocks an external source such as the offload tiers can load) without taking anything, and
:meth:`KVCacheManager.allocate_slots` admits it with that hit and grows its tables afterwards; ``free``
gives its blocks back. The connector of the external source, the pool's listeners and the groups are
given at construction. What differs by kind of group lives in one table object per group
(:mod:`prefixcache.core.group_tables` for attention, :mod:`prefixcache.core.state_table` for recurrent state);
the manager coordinates them: one hit for all, one room check before anything changes, one order of frees.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from prefixcache.core.block_pool import Block, BlockPool, BlockPoolListener
from prefixcache.core.eviction import EXPIRED, EvictionPolicy
from prefixcache.core.group_tables import make_table
from prefixcache.core.hashing import BlockHash, root_hash, warn_if_unsafe
from prefixcache.core.kv_cache_groups import (
    FULL_ATTENTION,
    KVCacheGroupSpec,
    check_groups,
    check_sub_blocks,
    checkpoint_boundary,
    full_hit,
    longest_common_hit,
)
from prefixcache.core.miss import (
    MISS_REASONS,
    EvictedHashes,
    PrefixLookup,
    RetentionRun,
    first_miss_reason,
    hittable_blocks,
    hittable_tokens,
)
from prefixcache.core.request import MultiModalFeature, Request
from prefixcache.core.retention import (
    DEFAULT_MAX_RETAINED_FRACTION,
    DEFAULT_MAX_RETENTION_TTL_S,
    DEFAULT_PRIORITY,
    block_directives,
    check_bounds,
)
from prefixcache.core.retention_rules import RetentionRule, make_retention_rule
from prefixcache.core.state_table import (
    DEFAULT_CHECKPOINT_POLICY,
    Checkpoint,
    CheckpointPolicy,
    StateTable,
    StateWork,
)
from prefixcache.core.sub_block import CopyOp, SubBlockIndex

# The block ids of one position in every group's table (None where a sliding group holds the null block).
BlockTargets = tuple[int | None, ...]


class KVConnector(Protocol):
    """K/V kept outside the pool that admission can load into it (the offload tiers' scheduler side).

    The manager calls it with the request's block hashes; ``start`` .. ``end`` is the range of block
    indexes a hit may still cover (after the pool's hit, before the last token's block).
    """

    def extend_hit(self, request: Request, block_hashes: Sequence[BlockHash], start: int, end: int) -> int:
        """How many blocks from ``start`` on the source holds; they are read now and staged for ``request``."""

    def held(self, request: Request, block_hashes: Sequence[BlockHash], start: int, end: int) -> dict[str, int]:
        """Tokens each medium would supply from ``start`` on, as ``extend_hit`` would take them; changes nothing."""

    def admitted(
        self, request: Request, block_hashes: Sequence[BlockHash], start: int, targets: Sequence[BlockTargets]
    ) -> None:
        """``request`` was admitted with the staged blocks ``start`` .. ``start + len(targets) - 1``: load each
        into its blocks ``targets[i]``, one a group."""

    def request_finished(self, request: Request) -> None:
        """Forget whatever was staged for ``request``."""

    def take_plan(self, cached_block_ids: Callable[[BlockHash], BlockTargets | None]) -> Any:
        """This step's transfers for the worker; ``cached_block_ids`` names the blocks that hold a hash in every
        group (None when some group lacks it)."""


@runtime_checkable
class StateConnector(KVConnector, Protocol):
    """A connector that also keeps state checkpoints (a model with recurrent layers), each under the hash of the
    block it ends, as the recurrent-state group keys them."""

    def holds_state(self, block_hash: BlockHash) -> bool:
        """Whether the source holds the checkpoint at the end of ``block_hash``'s block; reads nothing."""

    def stage_state(self, request: Request, block_hash: BlockHash) -> bool:
        """Read (and verify) that checkpoint now, staged for ``request``'s admission; False when it is not held
        or does not read back."""

    def state_admitted(self, request: Request, slot: int) -> None:
        """``request`` was admitted with its staged checkpoint: load it into working state slot ``slot``."""

    def checkpoints_saved(self, saved: Sequence[tuple[BlockHash, int, Block | None]]) -> None:
        """This step's forward pass saves these checkpoints (block hash, state slot, the pool's block of that hash,
        whose retention they have)."""

    def checkpoint_evicted(self, block_hash: BlockHash, slot: int, block: Block | None) -> None:
        """The checkpoint in ``slot`` is evicted (its slot is reused after this step's plan is taken); ``block``
        is the pool's block of that hash (None when gone), whose retention it had."""


@dataclass(slots=True)
class PrefixCacheStats:
    """Counted when a request is admitted: prompt tokens looked up, not computed, and missed.

    ``hits`` are the prompt tokens whose K/V was reused, from shared blocks, copied from a sub-block
    match (``copied_tokens`` of them) or loaded from an offload tier; this is the one definition of a hit
    everywhere in prefixcache. Every other prompt token is missed for one reason
    (:mod:`prefixcache.core.miss`), so ``queries == hits + sum(missed_tokens.values())``.

    A request admitted again after a preemption mostly re-reads the blocks it computed itself: a hit no
    sharing produced. Those admissions count apart, in ``preempted_requests``, ``preempted_queries`` (its
    tokens then) and ``preempted_hits``, so that ``hit_rate`` means sharing (vLLM's ``preempted`` flag).
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    copied_tokens: int = 0
    missed_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    retained_read_tokens: int = 0
    retained_written_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class PrefixHit:
    """What admitting a request now would reuse, from :meth:`KVCacheManager.find_prefix`.

    ``blocks[g]`` are group ``g``'s cached blocks for the first ``num_local_tokens`` (a sliding group's
    table holds the null block where its window does not reach); with a sub-block copy
    (``num_copied_tokens`` > 0, one full-attention group only) the last block is the copy source.
    ``num_external_tokens`` are whole blocks right after, which the connector staged and loads into
    new blocks. With a recurrent-state group (whose ``blocks`` entry is empty), ``checkpoint`` is the state
    at the hit's end (None for no hit, or when ``external_state``: the connector staged it), and
    ``junction_blocks`` the longer prefix the attention groups alone hold (0 when not longer), where admission
    leaves a junction checkpoint.
    """

    blocks: list[list[Block]]
    num_local_tokens: int = 0
    num_copied_tokens: int = 0
    num_external_tokens: int = 0
    checkpoint: Checkpoint | None = None
    junction_blocks: int = 0
    external_state: bool = False

    @property
    def num_tokens(self) -> int:
        """Prompt tokens the hit spares from computing: the first token to compute."""
        return self.num_local_tokens + self.num_external_tokens

    def block_ids(self) -> list[list[int]]:
        return [[block.block_id for block in blocks] for blocks in self.blocks]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _cached_lookup(cached: dict[BlockHash, Block | dict[int, Block]]) -> Callable[[BlockHash], Block | None]:
    """The first block holding a hash in one group's map (several when requests filled it independently)."""
    get = cached.get

    def lookup(block_hash: BlockHash) -> Block | None:
        entry = get(block_hash)
        if entry is None or type(entry) is Block:
            return entry
        return next(iter(entry.values()))

    return lookup


class KVCacheManager:
    """Owns the block pool and every running request's block tables, one table a KV cache group.

    ``find_prefix`` looks a request up without taking anything; ``allocate_slots`` admits it with that
    hit (taking references on the hit blocks, staging the connector's loads) and grows its tables;
    ``free`` gives the blocks back. Allocation that does not fit returns None and changes nothing. A
    sliding-window group gives back the blocks that left its window as the request advances (to the
    cached free queue, hash kept), its table holding the null block there. The record of recently
    evicted hashes, which tells an eviction's miss (``evicted``, ``expired``, ``evicted_below_retained``: why the
    block left) from a ``new`` one, remembers at least the last
    ``evicted_record_size`` of them (default: as many as the pool has blocks; 0 counts every such miss
    as ``new``).

    ``groups`` (default: one full-attention group, a plain prefix cache) come from the model;
    ``connector`` extends hits with K/V from outside the pool (the offload tiers); ``listeners`` hear the
    pool's changes (KV events, a router's index). Sub-block matching needs one full-attention group.

    Retention: each full block gets, when it is cached or hit, the priority and TTL of the request's
    ``retention`` ranges that wholly cover it (:func:`~prefixcache.core.retention.block_directives`; the
    TTL clamped to ``max_retention_ttl_s``), which the pool's eviction order honours. Retained blocks may hold
    ``max_retained_fraction`` of the pool, a tenant's ``max_tenant_retained_fraction`` (None: no quota);
    ``clock`` times the TTLs. ``retention_rule`` (a name from
    :data:`~prefixcache.core.retention_rules.RETENTION_RULES`, None: none) adds the engine's own directives,
    derived from what requests share: it hears every block position a request reaches, once, after the
    request's own directives were applied.

    A model with recurrent layers has a recurrent-state group last: ``num_state_slots`` working states
    (the most requests that run at once), ``num_checkpoint_slots`` checkpoints placed by
    ``checkpoint_policy`` (:mod:`prefixcache.core.state_table`). Its connector must be a
    :class:`StateConnector`: a hit then reaches as far as every attention group's blocks (pool, then connector)
    and a checkpoint at exactly that boundary (pool or connector) go, and evicted checkpoints go to it.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        hash_seed: str | None = None,
        watermark: float = 0.0,
        eviction_policy: str | EvictionPolicy = "lru",
        sub_block_size: int | None = None,
        evicted_record_size: int | None = None,
        groups: Sequence[KVCacheGroupSpec] = (FULL_ATTENTION,),
        connector: KVConnector | None = None,
        listeners: Sequence[BlockPoolListener] = (),
        max_retained_fraction: float = DEFAULT_MAX_RETAINED_FRACTION,
        max_retention_ttl_s: float = DEFAULT_MAX_RETENTION_TTL_S,
        max_tenant_retained_fraction: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        num_state_slots: int = 0,
        num_checkpoint_slots: int = 0,
        checkpoint_policy: CheckpointPolicy = DEFAULT_CHECKPOINT_POLICY,
        retention_rule: str | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        sub_block_size = block_size if sub_block_size is None else sub_block_size
        if sub_block_size <= 0 or block_size % sub_block_size:
            raise ValueError(f"sub_block_size must be a positive divisor of block_size, got {sub_block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        check_bounds(max_retained_fraction, max_retention_ttl_s, max_tenant_retained_fraction)
        self.max_retention_ttl_s = max_retention_ttl_s
        self.groups = check_groups(groups)
        check_sub_blocks(self.groups, block_size, sub_block_size)
        has_state = self.groups[-1].recurrent_state
        if has_state and enable_caching and connector is not None and not isinstance(connector, StateConnector):
            raise ValueError("this connector does not carry recurrent-state checkpoints; turn it off for this model")
        # The attention groups, which hold blocks: all but the recurrent-state group (last when there is one).
        self._attention = self.groups[:-1] if has_state else self.groups
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self.root_hash = root_hash(hash_algo, hash_seed)
        if enable_caching:
            warn_if_unsafe(hash_algo)
        self._hash_key = (hash_algo, self.root_hash, block_size)
        self.sub_block_size = sub_block_size
        self.sub_blocks = (
            SubBlockIndex(hash_algo, self.root_hash, block_size, sub_block_size)
            if enable_caching and sub_block_size < block_size
            else None
        )
        self.evicted = EvictedHashes(num_blocks if evicted_record_size is None else evicted_record_size)
        self.connector = connector if enable_caching else None
        pool_listeners: list[BlockPoolListener] = [self.sub_blocks] if self.sub_blocks else []
        pool_listeners.append(self.evicted)
        if isinstance(self.connector, BlockPoolListener):
            pool_listeners.append(self.connector)
        pool_listeners.extend(listeners)
        self._sliding = [g for g, spec in enumerate(self._attention) if spec.sliding_window is not None]
        num_usable = num_blocks - bool(self._sliding)
        self.pool = BlockPool(
            num_blocks,
            enable_caching,
            eviction_policy,
            pool_listeners,
            num_groups=len(self._attention),
            reserve_null_block=bool(self._sliding),
            max_retained_blocks=int(max_retained_fraction * num_usable),
            max_tenant_retained_blocks=None
            if max_tenant_retained_fraction is None
            else int(max_tenant_retained_fraction * num_usable),
            clock=clock,
        )
        self.null_block = self.pool.null_block
        self.retention_rule: RetentionRule | None = (
            make_retention_rule(retention_rule, self.pool, max_retention_ttl_s)
            if enable_caching and retention_rule is not None
            else None
        )
        self.watermark_blocks = int(watermark * self.pool.num_usable_blocks)
        self._block_tables = [make_table(spec, self.pool, block_size) for spec in self._attention]
        self._attention_lookups = [_cached_lookup(cached) for cached in self.pool.cached]
        self.state: StateTable | None = None
        if has_state:
            # Without caching nothing is checkpointed: no slot to save into.
            num_checkpoint_slots = num_checkpoint_slots if enable_caching else 0
            self.state = StateTable(
                num_state_slots,
                num_checkpoint_slots,
                checkpoint_policy,
                block_size,
                self._attention_lookups,
                group=len(self._attention),
                listeners=listeners,
                on_evicted=None if self.connector is None else self._checkpoint_evicted,
            )
        self._lookups = self._attention_lookups + ([self.state.lookup] if self.state else [])
        self._single_full = self.groups == (FULL_ATTENTION,)
        self._no_hit_blocks: list[list[Block]] = [[] for _ in self.groups]
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[list[Block]]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self._sub_block_requests: dict[str, Request] = {}
        self._sub_block_indexed: dict[str, int] = {}
        self._pending_copies: list[CopyOp] = []

    @property
    def num_blocks(self) -> int:
        """Blocks of the pool, the null block included."""
        return self.pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the null block (reserved when some group slides)."""
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_usable_blocks

    def peak_blocks(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once, computing at most
        ``max_chunk_tokens`` a step: every block in a full-attention group; in a sliding group, the window
        before a step plus the step's own tokens, once earlier blocks were given back."""
        all_blocks = _cdiv(num_tokens, self.block_size)
        total = 0
        for spec in self._attention:
            if spec.sliding_window is None:
                total += all_blocks
            else:
                in_window = _cdiv(min(max_chunk_tokens, num_tokens) + spec.sliding_window - 1, self.block_size) + 1
                total += min(all_blocks, in_window)
        return total

    def max_request_tokens(self, max_chunk_tokens: int) -> int:
        """The longest request (prompt plus output) whose :meth:`peak_blocks` fit in the pool."""
        low, high = 0, self.num_usable_blocks * self.block_size
        while low < high:
            mid = (low + high + 1) // 2
            if self.peak_blocks(mid, max_chunk_tokens) <= self.num_usable_blocks:
                low = mid
            else:
                high = mid - 1
        return low

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """The request's chained hashes for every full block of its tokens, hashing only new blocks."""
        if request.hash_key != self._hash_key:
            request.block_hashes = []
            request.hash_key = self._hash_key
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        done = len(hashes)
        if num_full > done:
            parent = hashes[-1] if hashes else self.root_hash
            hashes.extend(request.hash_blocks(self.hash_algo, parent, done, num_full - done, self.block_size))
        return hashes

    def find_prefix(self, request: Request) -> PrefixHit:
        """The longest prefix of the request every group can serve, extended by a sub-block copy or by the
        connector's blocks, whichever reaches further.

        Groups agree on the hit (:func:`~prefixcache.core.kv_cache_groups.longest_common_hit`). With
        sub-blocks on, the hit is extended by the longest written sub-prefix of the next block. The
        connector continues from the last whole block and wins when it beats the copy; its blocks are
        read and staged now. Capped so that at least the last token is computed (its logits are needed).
        Takes nothing: no reference, no move in the eviction order, until ``allocate_slots``.
        """
        hit = self._device_hit(request)
        if hit is None:
            return PrefixHit([[] for _ in self.groups])
        if self.connector is not None:
            hashes = self.block_hashes(request)
            max_blocks = hittable_blocks(request.num_tokens, self.block_size)
            if self.state is not None:
                return self._state_connector_hit(request, hashes, hit, max_blocks, read=True)
            num_blocks = hit.num_local_tokens // self.block_size
            num_external = self.connector.extend_hit(request, hashes, num_blocks, max_blocks) * self.block_size
            if num_external > hit.num_copied_tokens:
                if hit.num_copied_tokens:
                    hit.blocks[0].pop()
                hit.num_local_tokens = num_blocks * self.block_size
                hit.num_copied_tokens = 0
                hit.num_external_tokens = num_external
        return hit

    def device_hit_tokens(self, request: Request) -> int:
        """Tokens of the request's prefix the device cache would give it now: :meth:`find_prefix`'s hit without
        the connector (nothing read, staged or taken; the block hashes are computed once per request). Cheap
        enough for a scheduler to rank every waiting request by each step; asking a tier (a Redis round trip)
        per waiting request would not be."""
        hit = self._device_hit(request)
        return 0 if hit is None else hit.num_tokens

    def _device_hit(self, request: Request) -> PrefixHit | None:
        """The pool's hit (sub-block copy included), capped so the last token is computed; None when the request
        may not read the cache."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return None
        max_blocks = hittable_blocks(request.num_tokens, self.block_size)
        return self._local_hit(request, self.block_hashes(request), max_blocks)

    def lookup(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
    ) -> PrefixLookup:
        """What admitting this prompt now would find cached, and why the rest would miss.

        With a connector, the device's hit is extended by what it holds, split by medium, as admission
        would take it. Changes no state: no reference is taken, no free block moves in the eviction order,
        nothing is read from or staged by the connector, nothing is counted in the stats. Raises ValueError
        for a prompt no request could have (empty, bad ids).
        """
        request = Request("lookup", token_ids, cache_salt=cache_salt, lora_name=lora_name, mm_features=mm_features)
        by_tier = {"device": 0}
        num_cached = num_copied = num_no_checkpoint = 0
        retention: list[RetentionRun] = []
        if self.enable_caching and not request.skip_reading_prefix_cache:
            hashes = self.block_hashes(request)
            max_blocks = hittable_blocks(request.num_tokens, self.block_size)
            hit = self._local_hit(request, hashes, max_blocks)
            if self.connector is not None and self.state is not None:
                hit = self._state_connector_hit(request, hashes, hit, max_blocks, read=False)
                max_blocks = hit.num_tokens // self.block_size  # where the tiers' blocks end
            num_copied = hit.num_copied_tokens
            num_blocks = hit.num_local_tokens // self.block_size
            retention = self._retention_runs(hit.blocks[: len(self._attention)], num_blocks)
            num_cached = num_blocks * self.block_size
            if hit.junction_blocks:
                num_no_checkpoint = (hit.junction_blocks - num_blocks) * self.block_size
            if self.connector is not None:
                tiers = self.connector.held(request, hashes, num_blocks, max_blocks)
                if sum(tiers.values()) > num_copied:
                    num_copied = 0
                    by_tier |= tiers
                else:
                    by_tier |= dict.fromkeys(tiers, 0)
            by_tier["device"] = num_cached + num_copied
        total = sum(by_tier.values())
        missed = dict.fromkeys(MISS_REASONS, 0)
        self._count_missed(missed, request, total - num_copied, num_copied, num_no_checkpoint)
        return PrefixLookup(
            prompt_tokens=request.num_tokens,
            cached_tokens=total,
            cached_tokens_by_tier=by_tier,
            cached_prefix_end=total,
            copied_tokens=num_copied,
            block_size=self.block_size,
            first_miss_reason=first_miss_reason(missed),
            missed_tokens=missed,
            retention=retention,
            no_checkpoint_tokens=num_no_checkpoint,
        )

    def _retention_runs(self, blocks: list[list[Block]], num_blocks: int) -> list[RetentionRun]:
        """The retention of a hit's first ``num_blocks`` positions, in runs; reads the clock, changes nothing (a
        block whose TTL ended but that the pool has not moved yet shows as what it is: back at the default). A
        position no group holds (before the window of a model whose every group slides) is in no run."""
        runs: list[RetentionRun] = []
        null, now = self.null_block, self.pool.clock()
        for k in range(num_blocks):
            block = next((group[k] for group in blocks if group[k] is not null), None)
            if block is None:
                continue
            priority, ttl_s, expires_in = block.priority, block.ttl_s, None
            if block.ref_cnt == 0 and priority not in (EXPIRED, DEFAULT_PRIORITY):
                expires_in = block.expires_at - now
            if priority in (EXPIRED, DEFAULT_PRIORITY) or (expires_in is not None and expires_in <= 0):
                priority, ttl_s, expires_in = DEFAULT_PRIORITY, None, None
            start, end = k * self.block_size, (k + 1) * self.block_size
            last = runs[-1] if runs else None
            same = last is not None and (last.priority, last.ttl_s, last.expires_in_s) == (priority, ttl_s, expires_in)
            if same and last.end == start:
                runs[-1] = RetentionRun(last.start, end, priority, ttl_s, expires_in)
            else:
                runs.append(RetentionRun(start, end, priority, ttl_s, expires_in))
        return runs

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hit: PrefixHit | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[Block] | None:
        """Grow the request's tables to hold its computed tokens plus ``num_new_tokens`` and lookahead.

        The first call admits the request with ``hit`` from :meth:`find_prefix` (None: nothing reused);
        the connector's blocks get new blocks like new tokens but count as hits, and their loads are
        planned. Later calls pass no hit. Every block that becomes full is cached; a sliding group first
        gives back the blocks that left its window. Returns the newly allocated blocks (group by group),
        or None when they do not fit: then nothing changed, and a hit stays valid for another try.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError("num_new_tokens and num_lookahead_tokens must be >= 0")
        tables = self._tables.get(request.request_id)
        admitting = tables is None
        if not admitting and hit is not None:
            raise ValueError(f"request {request.request_id!r} is already admitted; pass no hit")
        block_size = self.block_size
        if admitting:
            hit = hit if hit is not None else PrefixHit(self._no_hit_blocks)
            self._check_hit(request, hit)
            num_computed = hit.num_tokens
            num_copied = hit.num_copied_tokens
            num_held = len(hit.blocks[0]) - (num_copied > 0)
        else:
            num_computed = request.num_computed_tokens
            num_held = len(tables[0])
        total = num_computed + num_new_tokens
        if total > request.num_tokens:
            raise ValueError(
                f"request {request.request_id!r}: {total} tokens scheduled, it only has {request.num_tokens}"
            )
        num_needed = _cdiv(total + num_lookahead_tokens, block_size)
        num_new_blocks = max(0, num_needed - num_held)
        block_tables = self._block_tables
        num_allocated = num_new_blocks * len(block_tables)
        # Each group's table says what it starts from (admission) or gives back (growth); the room is checked
        # for all of them before any changes. `nulls[g]`: new positions where group g holds the null block.
        nulls: list[int] | None = None
        leaving: list[list[int]] | None = None
        if admitting:
            if self.state is not None and not self.state.has_working_slot:
                return None
            tables, nulls = [], []
            for table_kind, blocks in zip(block_tables, hit.blocks, strict=False):
                table, num_null = table_kind.admission(blocks, num_held, num_computed, num_needed)
                tables.append(table)
                nulls.append(num_null)
            num_allocated -= sum(nulls)
            # Hit blocks in the free queue leave it when taken (the null block is never taken).
            null = self.null_block
            num_to_touch = sum(1 for table in tables for block in table if block.ref_cnt == 0 and block is not null)
            room = self.pool.num_free_blocks - num_to_touch - self.watermark_blocks
        else:
            room = self.pool.num_free_blocks
            if self._sliding:
                leaving = [table_kind.leaving(tables[g], num_computed) for g, table_kind in enumerate(block_tables)]
                room += sum(1 for g, positions in enumerate(leaving) for i in positions if tables[g][i].ref_cnt == 1)
        if room < num_allocated:
            return None

        new_blocks: list[Block] = []
        if admitting:
            null = self.null_block
            for table in tables:
                self.pool.touch(table if null is None else [block for block in table if block is not null])
            self._tables[request.request_id] = tables
            self._num_cached_blocks[request.request_id] = num_held
            if not request.counted_in_stats:
                request.retention_read_end = num_held + hit.num_external_tokens // block_size
            if num_held and (request.retention or self.pool.retained):
                self._apply_retention(request, tables, 0, num_held)
            if self.retention_rule is not None:
                self._tell_rule(request, tables, num_held)
            num_no_checkpoint = (hit.junction_blocks - num_held) * block_size if hit.junction_blocks else 0
            self._count_admission(
                request, num_held * block_size + hit.num_external_tokens, num_copied, num_no_checkpoint
            )
            if self.sub_blocks is not None:
                self._sub_block_requests[request.request_id] = request
                self._sub_block_indexed[request.request_id] = num_held * block_size
            if self.state is not None:
                self.state.admit(request, hit.checkpoint, hit.junction_blocks, loaded=hit.external_state)
        elif leaving is not None:
            for g, positions in enumerate(leaving):
                if positions:
                    block_tables[g].give_back(tables[g], positions)
        if num_new_blocks:
            for g, table in enumerate(tables):
                num_null = nulls[g] if nulls else 0
                if num_null:
                    table.extend([self.null_block] * num_null)
                blocks = self.pool.get_new_blocks(num_new_blocks - num_null)
                table.extend(blocks)
                new_blocks.extend(blocks)
        if admitting:
            if num_copied:
                source = hit.blocks[0][-1]
                self._pending_copies.append(CopyOp(source.block_id, tables[0][num_held].block_id, num_copied))
            if hit.num_external_tokens:
                end = num_held + hit.num_external_tokens // block_size
                targets = [self._targets(tables, i) for i in range(num_held, end)]
                self.connector.admitted(request, self.block_hashes(request), num_held, targets)
            if hit.external_state:
                self.connector.state_admitted(request, self.state.work(request).slot)
        if self.state is not None:
            self.state.schedule_saves(request, self.block_hashes(request), num_computed, total)
        request.num_computed_tokens = total
        if self.enable_caching:
            self._cache_full_blocks(request, tables, total // block_size)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks tail first, position by position across groups: its longest prefixes
        are evicted before their parents. Also drops what the connector staged for it."""
        if self.connector is not None:
            self.connector.request_finished(request)
        tables = self._tables.pop(request.request_id, None)
        if tables is None:
            return
        del self._num_cached_blocks[request.request_id]
        self._sub_block_requests.pop(request.request_id, None)
        self._sub_block_indexed.pop(request.request_id, None)
        null = self.null_block
        if null is None and len(tables) == 1:
            self.pool.free_blocks(reversed(tables[0]))
        else:
            self.pool.free_blocks(
                table[i] for i in range(len(tables[0]) - 1, -1, -1) for table in tables if table[i] is not null
            )
        if self.state is not None:
            self.state.free(request)
        request.num_computed_tokens = 0

    def take_transfers(self) -> tuple[list[CopyOp], Any]:
        """What the model runner must move around this step's forward pass: the sub-block hits' K/V copies
        (before it) and the connector's plan (None without a connector)."""
        ops, self._pending_copies = self._pending_copies, []
        plan = None
        if self.connector is not None:
            if self.state is not None:
                lookup = self._attention_lookups[0]
                self.connector.checkpoints_saved(
                    [(c.block_hash, c.slot, lookup(c.block_hash)) for c in self.state.pending]
                )
            plan = self.connector.take_plan(self._cached_block_ids)
        if self.state is not None:
            self.state.step_done()
        return ops, plan

    def state_work(self, request: Request) -> StateWork | None:
        """The recurrent state work of the step just scheduled for ``request`` (its working slot, the restore or
        zeroing before the forward pass, the checkpoints it saves); None without a recurrent-state group."""
        return None if self.state is None else self.state.work(request)

    def index_written_sub_blocks(self) -> None:
        """Index the sub-block prefixes of every token whose K/V a forward pass has now written.

        Call after each forward pass (a no-op without sub-blocks). Until then a sub-prefix is not
        findable, so no request copies K/V that has not been written yet.
        """
        if self.sub_blocks is None:
            return
        for request_id, request in self._sub_block_requests.items():
            start = self._sub_block_indexed[request_id]
            if request.num_computed_tokens // self.sub_block_size > start // self.sub_block_size:
                hashes = self.block_hashes(request)
                table = self._tables[request_id][0]
                self.sub_blocks.index_written(request, table, hashes, start, request.num_computed_tokens)
                self._sub_block_indexed[request_id] = request.num_computed_tokens

    def block_ids(self, request: Request) -> list[list[int]]:
        """The request's block table of each group (empty when it is not admitted); the null block's id where
        a sliding group holds nothing."""
        tables = self._tables.get(request.request_id)
        if tables is None:
            return [[] for _ in self.groups]
        ids = [[block.block_id for block in table] for table in tables]
        return ids + [[]] if self.state is not None else ids

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (and state checkpoint, and what the retention rule knew of them); returns False
        (and does nothing) while any block is in use."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.state is not None:
            self.state.reset()
        if self.retention_rule is not None:
            self.retention_rule.clear()
        return True

    def check_invariants(self) -> None:
        """Assert that pool, tables and index agree; raises AssertionError naming the first violation."""
        self.pool.check_invariants(table for tables in self._tables.values() for table in tables)
        if self.sub_blocks is not None:
            self.sub_blocks.check_invariants()
        if self.state is not None:
            self.state.check_invariants()
        for request_id, tables in self._tables.items():
            num_cached = self._num_cached_blocks[request_id]
            lengths = {len(table) for table in tables}
            assert len(lengths) == 1, f"{request_id}: groups' tables differ in length {sorted(lengths)}"
            for g, table in enumerate(tables):
                assert num_cached <= len(table), f"{request_id}: more cached blocks than table entries"
                for block in table[:num_cached]:
                    if block is self.null_block:
                        continue
                    assert block.block_hash is not None or not self.enable_caching, (
                        f"{request_id}: block {block.block_id} counted as cached holds no hash"
                    )
                    assert block.block_hash is None or block.group == g, (
                        f"{request_id}: block {block.block_id} of group {g} is cached in group {block.group}"
                    )
            for g in self._sliding:
                live = [i for i, block in enumerate(tables[g]) if block is not self.null_block]
                assert live == list(range(len(tables[g]) - len(live), len(tables[g]))), (
                    f"{request_id}: sliding group {g} holds a block after a null block"
                )

    def _local_hit(self, request: Request, hashes: list[BlockHash], max_blocks: int) -> PrefixHit:
        """The pool's hit. The groups agree on ``k`` whole blocks (a sliding group's table padded with the null
        block, the recurrent-state group's checkpoint apart); with sub-blocks, more tokens of block ``k`` come
        from the copy source appended to ``blocks[0]``."""
        junction = 0
        checkpoint = None
        if self._single_full:
            found = full_hit(self._lookups[0], hashes, max_blocks)
            num_blocks, blocks = len(found), [found]
        else:
            if self.state is not None:
                # Where the attention groups alone part from the request: a junction when the state stops short.
                junction, _ = longest_common_hit(
                    self._attention, self._attention_lookups, hashes, max_blocks, self.block_size
                )
                max_blocks = junction
            num_blocks, blocks = longest_common_hit(self.groups, self._lookups, hashes, max_blocks, self.block_size)
            for g in self._sliding:
                blocks[g] = [self.null_block] * (num_blocks - len(blocks[g])) + blocks[g]
            if self.state is not None:
                checkpoint = blocks[-1][0] if blocks[-1] else None
                blocks[-1] = []
                junction = junction if junction > num_blocks else 0
        room = request.num_tokens - 1 - num_blocks * self.block_size
        if self.sub_blocks is not None and room >= self.sub_block_size:
            found_copy = self.sub_blocks.lookup(request, hashes, num_blocks, room)
            if found_copy is not None:
                blocks[0].append(found_copy[0])
                return PrefixHit(blocks, num_blocks * self.block_size + found_copy[1], found_copy[1])
        return PrefixHit(blocks, num_blocks * self.block_size, checkpoint=checkpoint, junction_blocks=junction)

    def _state_connector_hit(
        self, request: Request, hashes: list[BlockHash], hit: PrefixHit, max_blocks: int, read: bool
    ) -> PrefixHit:
        """The pool's ``hit`` extended by the connector on a model with recurrent layers: the longest prefix of
        ``k`` blocks that the attention groups hold (the pool's blocks, then the connector's run right after
        them) with a checkpoint at exactly ``k`` (the pool's, else the connector's), the deepest first. With
        ``read``, the run and the checkpoint are read and staged (``find_prefix``); without, only the indexes
        are asked (``lookup``)."""
        block_size, connector = self.block_size, self.connector
        num_local = hit.num_local_tokens // block_size
        num_held = max(hit.junction_blocks, num_local)  # what the attention groups hold in the pool
        if read:
            num_run = connector.extend_hit(request, hashes, num_held, max_blocks)
        else:
            num_run = sum(connector.held(request, hashes, num_held, max_blocks).values()) // block_size

        def has_checkpoint(block_hash: BlockHash) -> bool:
            if self.state.lookup(block_hash) is not None:
                return True
            return connector.stage_state(request, block_hash) if read else connector.holds_state(block_hash)

        end = checkpoint_boundary(has_checkpoint, hashes, num_local, num_held + num_run)
        if end == num_local:
            return hit
        checkpoint = self.state.lookup(hashes[end - 1])
        num_pool = min(end, num_held)
        blocks = hit.blocks if num_pool == num_local else self._attention_blocks(hashes, num_pool) + [[]]
        return PrefixHit(
            blocks,
            num_pool * block_size,
            num_external_tokens=(end - num_pool) * block_size,
            checkpoint=checkpoint,
            junction_blocks=num_held if num_held > end else 0,
            external_state=checkpoint is None,
        )

    def _attention_blocks(self, hashes: list[BlockHash], num_blocks: int) -> list[list[Block]]:
        """Each attention group's cached blocks for the first ``num_blocks`` blocks, which they all hold (a
        sliding group's table padded with the null block before its window)."""
        _, blocks = longest_common_hit(self._attention, self._attention_lookups, hashes, num_blocks, self.block_size)
        for g in self._sliding:
            blocks[g] = [self.null_block] * (num_blocks - len(blocks[g])) + blocks[g]
        return blocks

    def _checkpoint_evicted(self, checkpoint: Checkpoint) -> None:
        """The state table evicts ``checkpoint``: the connector demotes it, with the retention of its block."""
        block = self._attention_lookups[0](checkpoint.block_hash)
        self.connector.checkpoint_evicted(checkpoint.block_hash, checkpoint.slot, block)

    def _targets(self, tables: list[list[Block]], position: int) -> BlockTargets:
        null = self.null_block
        return tuple(None if table[position] is null else table[position].block_id for table in tables)

    def _cached_block_ids(self, block_hash: BlockHash) -> BlockTargets | None:
        """A block holding ``block_hash`` in each group, or None when some group does not hold it."""
        ids = []
        for lookup in self._attention_lookups:
            block = lookup(block_hash)
            if block is None:
                return None
            ids.append(block.block_id)
        return tuple(ids)

    def _check_hit(self, request: Request, hit: PrefixHit) -> None:
        block_size = self.block_size
        num_full, num_copied = divmod(hit.num_local_tokens, block_size)
        if len(hit.blocks) != len(self.groups):
            raise ValueError(f"the hit has {len(hit.blocks)} groups' blocks, the cache {len(self.groups)} groups")
        copies_ok = num_copied == hit.num_copied_tokens and (
            num_copied == 0 or (self.sub_blocks is not None and num_copied % self.sub_block_size == 0)
        )
        others = hit.blocks[1 : len(self._block_tables)]
        if (
            len(hit.blocks[0]) != num_full + (num_copied > 0)
            or (others and any(len(blocks) != num_full for blocks in others))
            or (self.state is not None and hit.blocks[-1])
            or not copies_ok
        ):
            raise ValueError(
                f"num_local_tokens={hit.num_local_tokens} does not match the hit's blocks "
                f"{[len(blocks) for blocks in hit.blocks]}"
            )
        if hit.num_external_tokens and (num_copied or hit.num_external_tokens % block_size):
            raise ValueError("external tokens must be whole blocks right after a block-aligned cached prefix")
        if hit.num_external_tokens and self.connector is None:
            raise ValueError("a hit with external tokens needs a connector")
        if hit.num_tokens and hit.num_tokens >= request.num_tokens:
            raise ValueError("the cached prefix must leave at least one token to compute")
        if self.state is not None:
            self._check_checkpoint(request, hit, num_full)
        if not num_full and not num_copied:
            return
        hashes = self.block_hashes(request)
        stale: list[Block] = []
        if self.null_block is None and len(self.groups) == 1:  # one group: a block holds its hash there or not
            stale = [b for b, h in zip(hit.blocks[0][:num_full], hashes, strict=False) if b.block_hash != h]
        else:
            for g, blocks in enumerate(hit.blocks[: len(self._block_tables)]):
                first = 0  # a sliding group holds the null block before its window
                while first < num_full and blocks[first] is self.null_block:
                    first += 1
                stale += [
                    block
                    for block, block_hash in zip(blocks[first:num_full], hashes[first:num_full], strict=True)
                    if block.block_hash != block_hash or block.group != g
                ]
        source = hit.blocks[0][-1] if num_copied else None
        if (
            source is not None
            and not stale
            and not self.sub_blocks.holds(source, request, hashes, num_full, num_copied)
        ):
            stale = [source]
        if stale:
            raise ValueError(
                f"request {request.request_id!r}: cached block {stale[0].block_id} no longer holds the "
                "looked-up prefix (evicted since the lookup); look it up again"
            )

    def _apply_retention(self, request: Request, tables: list[list[Block]], start: int, end: int) -> None:
        """Give block positions ``start`` .. ``end`` - 1 the request's directives (hits and blocks about to be
        cached), then count, once per position, the prompt tokens read from or written into retained blocks."""
        directives = request.block_directives
        if directives is None:
            directives, ttl_clamped = block_directives(request.retention, self.block_size, self.max_retention_ttl_s)
            request.block_directives = directives
            if ttl_clamped:
                _note_clamp(request, "max_retention_ttl_s")
        pool, null, block_size = self.pool, self.null_block, self.block_size
        k = start
        while k < end and directives:  # in runs of positions that the same directive covers
            directive, run_end = None, end
            for d in directives:  # the best that covers k (they are sorted best first); where coverage changes
                if directive is None and d.covers(k):
                    directive = d
                if k < d.first < run_end:
                    run_end = d.first
                if d.end is not None and k < d.end < run_end:
                    run_end = d.end
            if directive is not None:  # tail first, as blocks are freed: a run's head is demoted last
                if null is None and len(tables) == 1:
                    blocks = tables[0][k:run_end]
                    blocks.reverse()
                else:
                    blocks = [t[i] for i in range(run_end - 1, k - 1, -1) for t in tables if t[i] is not null]
                for bound in pool.retain(blocks, directive.priority, directive.ttl_s, request.tenant):
                    _note_clamp(request, bound)
            k = run_end
        first = max(start, request.retention_accounted_blocks)
        if first >= end:
            return
        request.retention_accounted_blocks = end
        num_prompt = request.num_prompt_tokens
        last = min(end, _cdiv(num_prompt, block_size))
        if first >= last:
            return
        if null is None:
            row = tables[0][first:last]
        else:  # a sliding group holds the null block where its window does not reach: take a group that holds one
            row = [next((t[k] for t in tables if t[k] is not null), null) for k in range(first, last)]
        retained = [block.priority > DEFAULT_PRIORITY for block in row]
        split = min(max(request.retention_read_end - first, 0), len(retained))
        num_read, num_written = sum(retained[:split]) * block_size, sum(retained[split:]) * block_size
        overhang = last * block_size - num_prompt  # > 0: the prompt ends inside the last block
        if retained[-1] and overhang > 0:
            if split == len(retained):
                num_read -= overhang
            else:
                num_written -= overhang
        if num_written:  # by the TTL each written block is kept for (Anthropic splits its usage by TTL)
            by_ttl = request.num_retained_written_tokens_by_ttl
            for i in range(split, len(row)):
                if retained[i]:
                    tokens = block_size - overhang if i == len(row) - 1 and overhang > 0 else block_size
                    by_ttl[row[i].ttl_s] = by_ttl.get(row[i].ttl_s, 0) + tokens
        request.num_retained_read_tokens += num_read
        request.num_retained_written_tokens += num_written
        self.stats.retained_read_tokens += num_read
        self.stats.retained_written_tokens += num_written

    def _check_checkpoint(self, request: Request, hit: PrefixHit, num_full: int) -> None:
        """A hit of ``num_full`` pool blocks and the connector's after them needs a checkpoint at exactly where they
        end: the pool's ready one, or the connector's (``external_state``); none for no hit. A junction lies beyond
        it within the prompt's hittable blocks."""
        max_blocks = hittable_blocks(request.num_tokens, self.block_size)
        end = num_full + hit.num_external_tokens // self.block_size  # where the hit's blocks end
        if hit.junction_blocks and not end < hit.junction_blocks <= max_blocks:
            raise ValueError(f"junction_blocks={hit.junction_blocks} is not beyond the hit and within the prompt")
        checkpoint = hit.checkpoint
        if hit.external_state:
            if checkpoint is not None or end == 0 or self.connector is None:
                raise ValueError("a state from the connector needs a hit of blocks, a connector and no checkpoint")
            return
        if end == 0:
            if checkpoint is not None:
                raise ValueError("a hit of no blocks restores no checkpoint")
            return
        if checkpoint is None:
            raise ValueError(f"a hit of {end} blocks needs the recurrent state's checkpoint at its end")
        block_hash = self.block_hashes(request)[end - 1]
        if checkpoint.num_blocks != end or self.state.lookup(block_hash) is not checkpoint:
            raise ValueError(
                f"request {request.request_id!r}: the state checkpoint at block {end} is gone or not the "
                "looked-up one (evicted since the lookup); look it up again"
            )

    def _count_admission(
        self, request: Request, num_hit_tokens: int, num_copied_tokens: int, num_no_checkpoint_tokens: int
    ) -> None:
        stats = self.stats
        if request.counted_in_stats:  # admitted again after a preemption: its own blocks, mostly
            stats.preempted_requests += 1
            stats.preempted_queries += request.num_tokens
            stats.preempted_hits += num_hit_tokens + num_copied_tokens
            return
        request.counted_in_stats = True
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit_tokens + num_copied_tokens
        stats.copied_tokens += num_copied_tokens
        self._count_missed(stats.missed_tokens, request, num_hit_tokens, num_copied_tokens, num_no_checkpoint_tokens)

    def _count_missed(
        self,
        missed: dict[str, int],
        request: Request,
        num_hit_tokens: int,
        num_copied_tokens: int,
        num_no_checkpoint_tokens: int,
    ) -> None:
        """Add the request's missed prompt tokens to ``missed`` by reason, given what its lookup found
        (``num_no_checkpoint_tokens``: the attention groups' blocks right after the hit, a junction's).

        The reasons are defined in :mod:`prefixcache.core.miss`.
        """
        num_tokens = request.num_tokens
        if not self.enable_caching or request.skip_reading_prefix_cache:
            missed["skipped"] += num_tokens
            return
        missed["no_checkpoint"] += num_no_checkpoint_tokens
        held_end = num_hit_tokens + num_no_checkpoint_tokens  # what the attention groups hold
        cached_end = held_end + num_copied_tokens
        hittable_end = hittable_tokens(num_tokens, self.block_size)
        if cached_end < hittable_end:
            first_missing = self.block_hashes(request)[held_end // self.block_size]
            missed[self.evicted.cause(first_missing) or "new"] += hittable_end - cached_end
        missed["partial_block"] += num_tokens - max(cached_end, hittable_end)

    def _cache_full_blocks(self, request: Request, tables: list[list[Block]], num_full: int) -> None:
        start = self._num_cached_blocks[request.request_id]
        if num_full <= start:
            return
        hashes = self.block_hashes(request)
        if request.retention:  # before the pool announces them, so listeners see their retention
            self._apply_retention(request, tables, start, num_full)
        for g, table in enumerate(tables):
            self.pool.cache_full_blocks(request, table, hashes, start, num_full, self.block_size, g)
        self._num_cached_blocks[request.request_id] = num_full
        if self.retention_rule is not None:
            self._tell_rule(request, tables, num_full)

    def _tell_rule(self, request: Request, tables: list[list[Block]], end: int) -> None:
        """Tell the retention rule of the block positions up to ``end`` this request reached that it was not told of
        yet (a request admitted again after a preemption re-reads positions it already reported)."""
        start = request.rule_reached_blocks
        if end <= start:
            return
        request.rule_reached_blocks = end
        hashes, null = self.block_hashes(request), self.null_block
        self.retention_rule.reached(
            ((hashes[k], [table[k] for table in tables if table[k] is not null]) for k in range(start, end)),
            request.tenant,
        )


def _note_clamp(request: Request, bound: str) -> None:
    """Name a bound the request's directives ran into, once (the response reports them)."""
    if bound not in request.retention_clamped:
        request.retention_clamped.append(bound)
