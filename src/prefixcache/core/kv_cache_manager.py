"""The prefix-caching KV cache manager: finds a request's cached prefix and allocates its block table."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefixcache.core.block_pool import Block, BlockPool
from prefixcache.core.eviction import EvictionPolicy
from prefixcache.core.hashing import BlockHash, root_hash, warn_if_unsafe
from prefixcache.core.miss import (
    MISS_REASONS,
    EvictedHashes,
    PrefixLookup,
    first_miss_reason,
    hittable_blocks,
    hittable_tokens,
)
from prefixcache.core.request import MultiModalFeature, Request
from prefixcache.core.sub_block import CopyOp, SubBlockIndex

# Tokens per tier, "device" first, that admitting a request would find, given the device's hit.
TierLookup = Callable[[Request, int], dict[str, int]]


@dataclass(slots=True)
class PrefixCacheStats:
    """Counted once per request, when it is admitted: prompt tokens looked up, not computed, and missed.

    ``hits`` are the prompt tokens whose K/V was reused, from shared blocks, copied from a sub-block
    match (``copied_tokens`` of them) or loaded from an offload tier; this is the one definition of a hit
    everywhere in prefixcache. Every other prompt token is missed for one reason
    (:mod:`prefixcache.core.miss`), so ``queries == hits + sum(missed_tokens.values())``.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    copied_tokens: int = 0
    missed_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the block pool and every running request's block table.

    ``get_computed_blocks`` looks a prompt up without changing anything; ``allocate_slots`` admits
    it (taking references on the hit blocks) and grows its table; ``free`` gives the blocks back.
    Allocation that does not fit returns None and changes nothing. The record of recently evicted
    hashes, which tells an ``evicted`` miss from a ``new`` one, remembers at least the last
    ``evicted_record_size`` of them (default: as many as the pool has blocks; 0 counts every such
    miss as ``new``).
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
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        sub_block_size = block_size if sub_block_size is None else sub_block_size
        if sub_block_size <= 0 or block_size % sub_block_size:
            raise ValueError(f"sub_block_size must be a positive divisor of block_size, got {sub_block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self.root_hash = root_hash(hash_algo, hash_seed)
        if enable_caching:
            warn_if_unsafe(hash_algo)
        self._hash_key = (hash_algo, self.root_hash, block_size)
        self.watermark_blocks = int(watermark * num_blocks)
        self.sub_block_size = sub_block_size
        self.sub_blocks = (
            SubBlockIndex(hash_algo, self.root_hash, block_size, sub_block_size)
            if enable_caching and sub_block_size < block_size
            else None
        )
        self.evicted = EvictedHashes(num_blocks if evicted_record_size is None else evicted_record_size)
        listeners = [self.sub_blocks, self.evicted] if self.sub_blocks else [self.evicted]
        self.pool = BlockPool(num_blocks, enable_caching, eviction_policy, listeners)
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[Block]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self._sub_block_requests: dict[str, Request] = {}
        self._sub_block_indexed: dict[str, int] = {}
        self._pending_copies: list[CopyOp] = []

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

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

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest run of cached full blocks from the start of the request's tokens.

        With sub-blocks on, the hit is extended by the longest written sub-prefix of the next block;
        the last returned block is then the copy source and the token count is not block-aligned.
        Capped so that at least the last token is computed (its logits are needed). Changes no
        state: nothing is referenced until ``allocate_slots`` admits the request.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        hashes = self.block_hashes(request)
        max_blocks = hittable_blocks(request.num_tokens, self.block_size)
        get_cached = self.pool.get_cached_block
        hits: list[Block] = []
        for block_hash in hashes[:max_blocks]:
            block = get_cached(block_hash)
            if block is None:
                break
            hits.append(block)
        num_cached = len(hits) * self.block_size
        room = request.num_tokens - 1 - num_cached
        if self.sub_blocks is not None and room >= self.sub_block_size:
            found = self.sub_blocks.lookup(request, hashes, len(hits), room)
            if found is not None:
                hits.append(found[0])
                num_cached += found[1]
        return hits, num_cached

    def lookup(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
        tiers: TierLookup | None = None,
    ) -> PrefixLookup:
        """What admitting this prompt now would find cached, and why the rest would miss.

        ``tiers`` (the offload connector's ``lookup``) extends the device's hit with the blocks the offload
        tiers hold, as admission would, and splits it by tier. Changes no state: no reference is taken, no
        free block moves in the eviction order, nothing is counted in the stats. Raises ValueError for a
        prompt no request could have (empty, bad ids).
        """
        request = Request("lookup", token_ids, cache_salt=cache_salt, lora_name=lora_name, mm_features=mm_features)
        _, num_cached = self.get_computed_blocks(request)
        by_tier = {"device": num_cached} if tiers is None else tiers(request, num_cached)
        num_cached = sum(by_tier.values())
        num_copied = num_cached % self.block_size  # tiers extend only a block-aligned device hit
        missed = dict.fromkeys(MISS_REASONS, 0)
        self._count_missed(missed, request, num_cached - num_copied, num_copied)
        return PrefixLookup(
            prompt_tokens=request.num_tokens,
            cached_tokens=num_cached,
            cached_tokens_by_tier=by_tier,
            cached_prefix_end=num_cached,
            copied_tokens=num_copied,
            block_size=self.block_size,
            first_miss_reason=first_miss_reason(missed),
            missed_tokens=missed,
        )

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_cached_tokens: int = 0,
        cached_blocks: list[Block] | None = None,
        num_lookahead_tokens: int = 0,
        num_external_tokens: int = 0,
    ) -> list[Block] | None:
        """Grow the request's table to hold its computed tokens plus ``num_new_tokens`` and lookahead.

        The first call admits the request with the hit from ``get_computed_blocks``, extended by
        ``num_external_tokens`` whose K/V comes from outside the pool (the offload tiers): full blocks
        right after the cached prefix, which get new blocks like new tokens but count as hits. Every block
        that becomes full is cached. Returns the newly allocated blocks, or None (nothing changed) when
        they do not fit.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0 or num_external_tokens < 0:
            raise ValueError("num_new_tokens, num_lookahead_tokens and num_external_tokens must be >= 0")
        table = self._tables.get(request.request_id)
        admitting = table is None
        block_size = self.block_size
        if admitting:
            cached_blocks = cached_blocks or []
            self._check_hit(request, cached_blocks, num_cached_tokens, num_external_tokens)
            num_computed = num_cached_tokens + num_external_tokens
            num_copied = num_cached_tokens % block_size
            copy_source = cached_blocks[-1] if num_copied else None
            cached_blocks = cached_blocks[:-1] if num_copied else cached_blocks
            num_held = len(cached_blocks)
            num_to_touch = sum(1 for block in cached_blocks if block.ref_cnt == 0)
            reserve = self.watermark_blocks
        else:
            if cached_blocks or num_cached_tokens or num_external_tokens:
                raise ValueError(f"request {request.request_id!r} is already admitted; pass no cached blocks")
            num_computed = request.num_computed_tokens
            num_held = len(table)
            num_to_touch = 0
            reserve = 0
        total = num_computed + num_new_tokens
        if total > request.num_tokens:
            raise ValueError(
                f"request {request.request_id!r}: {total} tokens scheduled, it only has {request.num_tokens}"
            )
        num_new_blocks = max(0, _cdiv(total + num_lookahead_tokens, block_size) - num_held)
        if self.pool.num_free_blocks - num_new_blocks - num_to_touch < reserve:
            return None

        if admitting:
            self.pool.touch(cached_blocks)
            table = list(cached_blocks)
            self._tables[request.request_id] = table
            self._num_cached_blocks[request.request_id] = len(cached_blocks)
            self._count_admission(request, num_held * block_size + num_external_tokens, num_copied)
            if self.sub_blocks is not None:
                self._sub_block_requests[request.request_id] = request
                self._sub_block_indexed[request.request_id] = num_held * block_size
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        table.extend(new_blocks)
        if admitting and copy_source is not None:
            self._pending_copies.append(CopyOp(copy_source.block_id, table[num_held].block_id, num_copied))
        request.num_computed_tokens = total
        if self.enable_caching:
            self._cache_full_blocks(request, table, total // block_size)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks tail first: its longest prefixes are evicted before their parents."""
        table = self._tables.pop(request.request_id, None)
        if table is None:
            return
        del self._num_cached_blocks[request.request_id]
        self._sub_block_requests.pop(request.request_id, None)
        self._sub_block_indexed.pop(request.request_id, None)
        self.pool.free_blocks(reversed(table))
        request.num_computed_tokens = 0

    def take_copy_ops(self) -> list[CopyOp]:
        """The K/V copies of this step's sub-block hits, for the model runner to do before the forward pass."""
        ops, self._pending_copies = self._pending_copies, []
        return ops

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
                table = self._tables[request_id]
                self.sub_blocks.index_written(request, table, hashes, start, request.num_computed_tokens)
                self._sub_block_indexed[request_id] = request.num_computed_tokens

    def block_ids(self, request: Request) -> list[int]:
        """The request's block table (empty when it is not admitted)."""
        return [block.block_id for block in self._tables.get(request.request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix; returns False (and does nothing) while any block is in use."""
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Assert that pool, tables and index agree; raises AssertionError naming the first violation."""
        self.pool.check_invariants(self._tables.values())
        if self.sub_blocks is not None:
            self.sub_blocks.check_invariants()
        for request_id, table in self._tables.items():
            num_cached = self._num_cached_blocks[request_id]
            assert num_cached <= len(table), f"{request_id}: more cached blocks than table entries"
            for block in table[:num_cached]:
                assert block.block_hash is not None or not self.enable_caching, (
                    f"{request_id}: block {block.block_id} counted as cached holds no hash"
                )

    def _check_hit(
        self, request: Request, cached_blocks: list[Block], num_cached_tokens: int, num_external_tokens: int
    ) -> None:
        num_full, num_copied = divmod(num_cached_tokens, self.block_size)
        copies_ok = num_copied == 0 or (self.sub_blocks is not None and num_copied % self.sub_block_size == 0)
        if len(cached_blocks) != num_full + (num_copied > 0) or not copies_ok:
            raise ValueError(f"num_cached_tokens={num_cached_tokens} does not match {len(cached_blocks)} cached blocks")
        if num_external_tokens and (num_copied or num_external_tokens % self.block_size):
            raise ValueError("external tokens must be whole blocks right after a block-aligned cached prefix")
        num_hit = num_cached_tokens + num_external_tokens
        if num_hit and num_hit >= request.num_tokens:
            raise ValueError("the cached prefix must leave at least one token to compute")
        if not cached_blocks:
            return
        hashes = self.block_hashes(request)
        stale = [b for b, h in zip(cached_blocks[:num_full], hashes, strict=False) if b.block_hash != h]
        if (
            num_copied
            and not stale
            and not self.sub_blocks.holds(cached_blocks[-1], request, hashes, num_full, num_copied)
        ):
            stale = [cached_blocks[-1]]
        if stale:
            raise ValueError(
                f"request {request.request_id!r}: cached block {stale[0].block_id} no longer holds the "
                "looked-up prefix (evicted since the lookup); look it up again"
            )

    def _count_admission(self, request: Request, num_hit_tokens: int, num_copied_tokens: int) -> None:
        if request.counted_in_stats:
            return
        request.counted_in_stats = True
        stats = self.stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit_tokens + num_copied_tokens
        stats.copied_tokens += num_copied_tokens
        self._count_missed(stats.missed_tokens, request, num_hit_tokens, num_copied_tokens)

    def _count_missed(
        self, missed: dict[str, int], request: Request, num_hit_tokens: int, num_copied_tokens: int
    ) -> None:
        """Add the request's missed prompt tokens to ``missed`` by reason, given what its lookup found.

        The reasons are defined in :mod:`prefixcache.core.miss`.
        """
        num_tokens = request.num_tokens
        if not self.enable_caching or request.skip_reading_prefix_cache:
            missed["skipped"] += num_tokens
            return
        cached_end = num_hit_tokens + num_copied_tokens
        hittable_end = hittable_tokens(num_tokens, self.block_size)
        if cached_end < hittable_end:
            first_missing = self.block_hashes(request)[num_hit_tokens // self.block_size]
            missed["evicted" if first_missing in self.evicted else "new"] += hittable_end - cached_end
        missed["partial_block"] += num_tokens - max(cached_end, hittable_end)

    def _cache_full_blocks(self, request: Request, table: list[Block], num_full: int) -> None:
        start = self._num_cached_blocks[request.request_id]
        if num_full <= start:
            return
        self.pool.cache_full_blocks(request, table, self.block_hashes(request), start, num_full, self.block_size)
        self._num_cached_blocks[request.request_id] = num_full
