"""The fixed pool of KV blocks, the free queue and the map from block hash to cached block, per KV cache group.

Eviction is lazy: a freed block keeps its hash and stays findable until it is popped for reuse;
only then is its map entry dropped. Whatever must follow the index (KV cache events, the sub-block
index, offload tiers, the record of evicted hashes) is a :class:`BlockPoolListener` given at construction.

Retention (:mod:`prefixcache.core.retention`): a block carries the priority, TTL and tenant of the directive that
last marked it. Free cached blocks leave in the order expired first (their TTL ended while free), then lowest
priority, least recently used within a priority; at the default priority the pool's eviction policy (LRU or ARC)
decides, so without directives nothing changes. A TTL runs from the block's last use (when it is freed) and its
end returns the block to the default priority. Retained blocks (priority above the default) are bounded: past
``max_retained_blocks`` in all, or a tenant's ``max_tenant_retained_blocks``, the least recently marked ones (a
hit with the same directive marks a block again) are demoted to the default priority, so an allocation never
fails because of them.

Every KV cache group (:mod:`prefixcache.core.kv_cache_groups`) draws from the one pool and has its own
map from hash to block: a block belongs to one group at a time, so the same tokens are cached once per
group. When some group slides, block 0 is the *null block*: never handed out, never written, it stands
in a sliding group's table for the blocks that left (or never entered) the window.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prefixcache.core.eviction import EXPIRED, EvictionPolicy, RetainedQueue, make_eviction_policy
from prefixcache.core.hashing import BlockHash, ExtraKeys
from prefixcache.core.retention import DEFAULT_PRIORITY

if TYPE_CHECKING:
    from prefixcache.core.request import Request


@dataclass(slots=True, eq=False)
class Block:
    """One KV block: ``block_id`` indexes the cache tensors; ``block_hash`` is set while it is cached, in the
    map of KV cache group ``group``. ``priority``, ``ttl_s`` and ``tenant`` come from the retention directive that
    marked it (``EXPIRED`` while it waits free after its TTL ended); ``expires_at`` is set when it is freed."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    group: int = 0
    priority: int = DEFAULT_PRIORITY
    ttl_s: float = 0.0
    tenant: str | None = None
    expires_at: float = 0.0


PRIORITY_CLASSES = ("expired", "low", "default", "retained")

# Why a cached block was evicted (``BlockPoolListener.blocks_evicted``), known only at that moment: ``expired``, its
# TTL had ended while it was free; ``evicted_below_retained``, it was at or below the default priority while free
# blocks above the default stayed (without those directives a least recently used one of them could have gone
# instead); ``evicted``, neither (plain pressure: a larger cache would have kept it).
EVICTED, EXPIRED_CAUSE, BELOW_RETAINED = "evicted", "expired", "evicted_below_retained"
EVICTION_CAUSES = (EVICTED, EXPIRED_CAUSE, BELOW_RETAINED)


def priority_class(priority: int) -> str:
    """The class a priority is counted in: ``retained`` above the default, ``low`` below, ``expired`` after a TTL."""
    if priority == DEFAULT_PRIORITY:
        return "default"
    if priority == EXPIRED:
        return "expired"
    return "retained" if priority > DEFAULT_PRIORITY else "low"


@dataclass(slots=True)
class RetentionCounters:
    """Blocks hit, evicted and expired by priority class (:data:`PRIORITY_CLASSES`); expirations are counted by
    the class the block had before its TTL ended."""

    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PRIORITY_CLASSES, 0))
    evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PRIORITY_CLASSES, 0))
    expirations: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PRIORITY_CLASSES, 0))


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """Consecutive blocks of one request whose hashes just became findable (first copy of each).

    ``parent_block_hash`` is the hash of the block before the first one, None at the start of a
    prompt; ``token_ids`` are all the blocks' tokens in order; ``extra_keys`` has one entry a block;
    ``group`` is the KV cache group whose map now holds them. ``retention`` has each block's ``(priority,
    ttl_s)`` (``ttl_s`` None at the default priority) when a retention directive marked some of them (None: none
    was).
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None
    extra_keys: list[ExtraKeys | None]
    group: int = 0
    retention: list[tuple[int, float | None]] | None = None


class BlockPoolListener:
    """Told of every change to what the pool can serve. Every method does nothing unless overridden.

    Calls come in the order the changes happen. ``blocks_stored`` comes when blocks are allocated, before
    their K/V is written: a listener that reports to others holds them until the forward pass ran.
    """

    def blocks_stored(self, stored: StoredBlocks) -> None:
        """Hashes that were not in ``stored.group``'s map now are (a duplicate of a cached hash is not reported)."""

    def blocks_removed(self, block_hashes: list[BlockHash], group: int) -> None:
        """The last block of each of these hashes in ``group`` is being reused: that group no longer holds them."""

    def blocks_evicted(self, block_hashes: list[BlockHash], group: int, causes: list[str] | None) -> None:
        """The same removal as ``blocks_removed`` (called just after it), with why each hash left: ``causes[i]``
        (one of :data:`EVICTION_CAUSES`) for ``block_hashes[i]``, or None when every one left as plain ``evicted``
        (no directive was in play: the common case costs no list). For a listener that needs the cause."""

    def block_reused(self, block: Block, last_copy: bool) -> None:
        """``block`` is about to be overwritten, whether or not it held a hash (in ``block.group``);
        ``last_copy``: it was the last block of its group holding that hash. It still has the priority (and
        ``ttl_s``, ``expires_at``) it was evicted at."""

    def cache_cleared(self) -> None:
        """Every cached hash was dropped at once (reset)."""


def _eviction_cause(lowest: int, highest: int) -> str:
    """Why the block at the head of the retained queue's ``lowest`` level leaves, ``highest`` its top level."""
    if lowest == EXPIRED:
        return EXPIRED_CAUSE
    return BELOW_RETAINED if lowest < DEFAULT_PRIORITY < highest else EVICTED


def _overriding(listeners: list[BlockPoolListener], event: str) -> list[BlockPoolListener]:
    """The listeners that override ``event``: the hot paths skip what no one listens to (a call per reused
    block, building ``StoredBlocks``)."""
    default = getattr(BlockPoolListener, event)
    return [listener for listener in listeners if getattr(type(listener), event) is not default]


class BlockPool:
    """Hands out blocks, takes them back, and keeps the prefix index of every KV cache group.

    Free blocks live in three queues: blocks holding no cached prefix (reused first, oldest first), cached
    blocks at the default priority, ordered by the eviction policy, whatever their group, and cached blocks
    of another priority (``retained_free``, see the module's docstring). A cached hash maps, in its
    group's map, to one block, or to several when requests filled identical blocks independently
    (lookups return the first one cached). ``reserve_null_block`` keeps block 0 out of circulation as
    the null block (the pool then hands out ``num_blocks - 1``). ``clock`` (seconds; a fake one in tests)
    times the TTLs.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        eviction_policy: str | EvictionPolicy = "lru",
        listeners: Sequence[BlockPoolListener] = (),
        num_groups: int = 1,
        reserve_null_block: bool = False,
        max_retained_blocks: int | None = None,
        max_tenant_retained_blocks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_blocks <= reserve_null_block:
            raise ValueError(f"num_blocks must be more than {int(reserve_null_block)}, got {num_blocks}")
        if num_groups < 1:
            raise ValueError(f"num_groups must be positive, got {num_groups}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(block_id=i) for i in range(num_blocks)]
        self.null_block: Block | None = self.blocks[0] if reserve_null_block else None
        self.usable_blocks = self.blocks[1:] if reserve_null_block else self.blocks
        self.uncached_free: deque[Block] = deque(self.usable_blocks)
        self.evictable: EvictionPolicy = make_eviction_policy(eviction_policy)
        self.retained_free = RetainedQueue()
        self.clock = clock
        self.max_retained_blocks = len(self.usable_blocks) if max_retained_blocks is None else max_retained_blocks
        self.max_tenant_retained_blocks = max_tenant_retained_blocks
        # Blocks above the default priority, free or in use, least recently marked first (all, and by tenant).
        self.retained: OrderedDict[int, Block] = OrderedDict()
        self.retained_by_tenant: dict[str, OrderedDict[int, Block]] = {}
        self.retention_counters = RetentionCounters()
        # Blocks not at the default priority, in any state: while none is, hits and frees run today's loops.
        self.num_marked = 0
        # One map a group, never replaced (the groups' managers hold them).
        self.cached: list[dict[BlockHash, Block | dict[int, Block]]] = [{} for _ in range(num_groups)]
        self.listeners = list(listeners)
        self._on_stored = _overriding(self.listeners, "blocks_stored")
        self._on_removed = _overriding(self.listeners, "blocks_removed")
        self._on_evicted = _overriding(self.listeners, "blocks_evicted")
        self._on_reused = _overriding(self.listeners, "block_reused")
        self._on_cleared = _overriding(self.listeners, "cache_cleared")

    @property
    def num_usable_blocks(self) -> int:
        """Blocks the pool hands out: all but the null block."""
        return len(self.usable_blocks)

    @property
    def num_free_blocks(self) -> int:
        num_free = len(self.uncached_free) + len(self.evictable)
        return num_free + len(self.retained_free) if self.retained_free.priorities else num_free

    def eviction_order(self) -> list[Block]:
        """The free cached blocks in the order they would be evicted now (for tests and ``explain``)."""
        self.expire()
        retained = list(self.retained_free)
        split = next((i for i, b in enumerate(retained) if b.priority > DEFAULT_PRIORITY), len(retained))
        return retained[:split] + list(self.evictable) + retained[split:]

    def expire(self) -> None:
        """Move the free blocks whose TTL has ended to the expired level (back at the default priority once they
        leave it), counting each and releasing its place in the retained share."""
        queue = self.retained_free
        next_expiry = queue.next_expiry()
        if next_expiry is None:
            return
        now = self.clock()
        if next_expiry > now:
            return
        for block, priority in queue.expire(now):
            self.retention_counters.expirations[priority_class(priority)] += 1
            self._forget_retained(block, priority)
            block.tenant = None

    def retain(self, blocks: Iterable[Block], priority: int, ttl_s: float, tenant: str | None) -> list[str]:
        """Mark cached blocks in use with a directive's priority and TTL; returns the bounds they ran into.

        A block another tenant marked is left as it is. Past the tenant's quota, then past the retained share,
        the least recently marked retained blocks (possibly these) are demoted to the default priority.
        """
        retained = self.retained
        raising = priority > DEFAULT_PRIORITY
        owned = self.retained_by_tenant.setdefault(tenant, OrderedDict()) if raising and tenant is not None else None
        for block in blocks:
            old = block.priority
            if old != DEFAULT_PRIORITY:
                if block.tenant != tenant:
                    continue
                if old == priority and block.ttl_s == ttl_s:  # renewed: only its place among the retained moves
                    if raising:
                        retained.move_to_end(block.block_id)
                        if owned is not None:
                            owned.move_to_end(block.block_id)
                    continue
                self._forget_retained(block, old)
                self.num_marked -= priority == DEFAULT_PRIORITY
            else:
                self.num_marked += priority != DEFAULT_PRIORITY
            block.priority, block.ttl_s = priority, ttl_s
            block.tenant = None if priority == DEFAULT_PRIORITY else tenant
            if raising:
                retained[block.block_id] = block
                if owned is not None:
                    owned[block.block_id] = block
        return self._enforce_bounds(owned) if raising else []

    def _enforce_bounds(self, owned: OrderedDict[int, Block] | None) -> list[str]:
        """Demote the oldest retained blocks past the tenant's quota (its own first), then past the share."""
        bounds: list[str] = []
        if owned is not None:
            quota = self.max_tenant_retained_blocks
            if quota is not None and len(owned) > quota:
                bounds.append("max_tenant_retained_fraction")
                while len(owned) > quota:
                    self._demote(next(iter(owned.values())))
        if len(self.retained) > self.max_retained_blocks:
            bounds.append("max_retained_fraction")
            while len(self.retained) > self.max_retained_blocks:
                self._demote(next(iter(self.retained.values())))
        return bounds

    def retained_blocks_by_tenant(self) -> dict[str, int]:
        """Blocks above the default priority, free or in use, by tenant ("" for requests without one)."""
        self.expire()
        counts = {tenant: len(owned) for tenant, owned in self.retained_by_tenant.items() if owned}
        untenanted = len(self.retained) - sum(counts.values())
        if untenanted:
            counts[""] = untenanted
        return counts

    def _forget_retained(self, block: Block, priority: int) -> None:
        """Drop a block that was above the default priority from the retained share (and its tenant's)."""
        if priority > DEFAULT_PRIORITY:
            del self.retained[block.block_id]
            if block.tenant is not None:  # the tenant's table stays, if empty: a retain call may be filling it
                del self.retained_by_tenant[block.tenant][block.block_id]

    def _demote(self, block: Block) -> None:
        """Return a retained block to the default priority; a free one joins the eviction policy's queue."""
        self._forget_retained(block, block.priority)
        self.num_marked -= 1
        if block.ref_cnt == 0:
            self.retained_free.remove(block)
            block.priority, block.tenant = DEFAULT_PRIORITY, None
            self.evictable.push(block)
        else:
            block.priority, block.tenant = DEFAULT_PRIORITY, None

    def _pop_retained(self) -> Block:
        """Evict the least recently freed block of the lowest priority in the retained queue (expired first)."""
        priority = self.retained_free.priorities[0]
        block = self.retained_free.pop_lowest()
        self.retention_counters.evictions[priority_class(priority)] += 1
        self._forget_retained(block, priority)
        self.num_marked -= 1
        block.tenant = None  # its priority stays until the listeners heard of the reuse (offload demotes by it)
        return block

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> Block | None:
        entry = self.cached[group].get(block_hash)
        if entry is None or type(entry) is Block:
            return entry
        return next(iter(entry.values()))

    def touch(self, blocks: Sequence[Block]) -> None:
        """Take a reference on hit blocks (never the null block); a free one leaves the free queue. A hit on a
        block whose TTL ended finds it back at the default priority."""
        evictable = self.evictable
        hits = self.retention_counters.hits
        if not self.num_marked:  # no directive anywhere: today's loop
            for block in blocks:
                if block.ref_cnt == 0:
                    evictable.remove(block)
                block.ref_cnt += 1
            hits["default"] += len(blocks)
            return
        self.expire()
        retained_free = self.retained_free
        num_retained = num_low = num_expired = 0
        for block in blocks:
            priority = block.priority
            if priority == DEFAULT_PRIORITY:
                if block.ref_cnt == 0:
                    evictable.remove(block)
            else:
                if priority > DEFAULT_PRIORITY:
                    num_retained += 1
                elif priority == EXPIRED:
                    num_expired += 1
                else:
                    num_low += 1
                if block.ref_cnt == 0:
                    retained_free.remove(block)
                    if priority == EXPIRED:
                        block.priority = DEFAULT_PRIORITY
                        self.num_marked -= 1
            block.ref_cnt += 1
        hits["default"] += len(blocks) - num_retained - num_low - num_expired
        hits["retained"] += num_retained
        hits["low"] += num_low
        hits["expired"] += num_expired

    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        """Pop ``num_blocks`` free blocks (caller checked there are enough), evicting cached ones last.

        An evicted block leaves its group's map; listeners hear of the hashes whose last block it was.
        """
        uncached, evictable, on_reused, maps = self.uncached_free, self.evictable, self._on_reused, self.cached
        retained_levels = self.retained_free.priorities  # the lowest first
        num_default_free = 0
        if retained_levels:
            self.expire()  # once: the clock does not move within one call
            num_default_free = len(evictable)
        # Causes are told apart only while some free block is not at the default priority: otherwise all are plain.
        causes: list[list[str]] | None = [[] for _ in maps] if retained_levels and self._on_evicted else None
        out: list[Block] = []
        removed: list[list[BlockHash]] | None = None  # by group, made at the first eviction
        num_default_evicted = 0
        for _ in range(num_blocks):
            if uncached:
                block = uncached.popleft()
            elif retained_levels and (retained_levels[0] < DEFAULT_PRIORITY or num_default_evicted == num_default_free):
                cause = _eviction_cause(retained_levels[0], retained_levels[-1])
                block = self._pop_retained()  # expired or low before the default, retained after it
            else:
                cause = BELOW_RETAINED if retained_levels and retained_levels[-1] > DEFAULT_PRIORITY else EVICTED
                block = evictable.pop()
                num_default_evicted += 1
            block_hash = block.block_hash
            last_copy = False
            if block_hash is not None:
                cached = maps[block.group]
                entry = cached[block_hash]
                if type(entry) is Block:
                    del cached[block_hash]
                    last_copy = True
                    if removed is None:
                        removed = [[] for _ in maps]
                    removed[block.group].append(block_hash)
                    if causes is not None:
                        causes[block.group].append(cause)
                else:
                    del entry[block.block_id]
                    if len(entry) == 1:
                        cached[block_hash] = next(iter(entry.values()))
            for listener in on_reused:
                listener.block_reused(block, last_copy)
            if block.priority != DEFAULT_PRIORITY:  # popped from the retained queue
                block.priority = DEFAULT_PRIORITY
            block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        if num_default_evicted:
            self.retention_counters.evictions["default"] += num_default_evicted
        for group, hashes in enumerate(removed or ()):
            if hashes:
                for listener in self._on_removed:
                    listener.blocks_removed(hashes, group)
                group_causes = None if causes is None else causes[group]
                for listener in self._on_evicted:
                    listener.blocks_evicted(hashes, group, group_causes)
        return out

    def cache_full_blocks(
        self,
        request: Request,
        table: list[Block],
        block_hashes: list[BlockHash],
        start: int,
        end: int,
        block_size: int,
        group: int = 0,
    ) -> None:
        """Index blocks ``start`` .. ``end`` - 1 of ``request``'s table of ``group``, which just became full
        (null entries and blocks already holding a hash, hits, are skipped).

        A hash already in the group's map gets the block too (two requests filled it independently).
        Listeners hear of each run of consecutive blocks whose hashes are new to the group.
        """
        runs: list[tuple[int, int]] = []
        null, cached = self.null_block, self.cached[group]
        for i in range(start, end):
            block = table[i]
            if block is null or block.block_hash is not None:  # a hit block keeps its hash
                continue
            block_hash = block.block_hash = block_hashes[i]
            block.group = group
            entry = cached.get(block_hash)
            if entry is None:  # new to the group
                cached[block_hash] = block
                if runs and runs[-1][1] == i:
                    runs[-1] = (runs[-1][0], i + 1)
                else:
                    runs.append((i, i + 1))
            elif type(entry) is Block:
                cached[block_hash] = {entry.block_id: entry, block.block_id: block}
            else:
                entry[block.block_id] = block
        if not self._on_stored:
            return
        for first, last in runs:
            blocks = table[first:last]
            marked = any(block.priority != DEFAULT_PRIORITY for block in blocks)
            stored = StoredBlocks(
                block_hashes=block_hashes[first:last],
                parent_block_hash=block_hashes[first - 1] if first else None,
                token_ids=request.all_token_ids[first * block_size : last * block_size],
                block_size=block_size,
                lora_name=request.lora_name,
                extra_keys=[request.block_extra_keys(k, block_size) for k in range(first, last)],
                group=group,
                retention=[(b.priority, None if b.priority == DEFAULT_PRIORITY else b.ttl_s) for b in blocks]
                if marked
                else None,
            )
            for listener in self._on_stored:
                listener.blocks_stored(stored)

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block (never the null block), in eviction order (the first freed is
        evicted first). A block's TTL starts now: it is last used (its place in the retained share moves only when
        a directive marks it again)."""
        uncached, evictable = self.uncached_free, self.evictable
        if not self.num_marked:  # no directive anywhere: today's loop
            for block in blocks:
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    if block.block_hash is None:
                        uncached.append(block)
                    else:
                        evictable.push(block)
            return
        marked: list[Block] | None = None
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    uncached.append(block)
                elif block.priority == DEFAULT_PRIORITY:
                    evictable.push(block)
                elif marked is None:
                    marked = [block]
                else:
                    marked.append(block)
        if marked is not None:
            self.retained_free.push(marked, self.clock())

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.usable_blocks:
            block.block_hash = None
            block.priority, block.tenant = DEFAULT_PRIORITY, None
        for cached in self.cached:
            cached.clear()
        self.evictable.clear()
        self.retained_free.clear()
        self.retained.clear()
        self.retained_by_tenant.clear()
        self.num_marked = 0
        self.uncached_free = deque(self.usable_blocks)
        for listener in self._on_cleared:
            listener.cache_cleared()
        return True

    def check_invariants(self, block_tables: Iterable[list[Block]]) -> None:
        """Assert the pool's bookkeeping; ``block_tables`` are all live tables. For tests and debugging."""
        null = self.null_block
        holders: dict[int, int] = {}
        for table in block_tables:
            for block in table:
                if block is not null:
                    holders[block.block_id] = holders.get(block.block_id, 0) + 1
        free_ids = [b.block_id for b in self.uncached_free] + [b.block_id for b in self.evictable]
        free_ids += [b.block_id for b in self.retained_free]
        assert len(free_ids) == len(set(free_ids)), "a block is in the free queues twice"
        free = set(free_ids)
        if null is not None:
            assert null.block_id not in free, "the null block is in a free queue"
            assert null.block_hash is None and null.ref_cnt == 0, "the null block was handed out"
        for block in self.usable_blocks:
            if block.block_id in free:
                assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
                assert block.block_id not in holders, f"free block {block.block_id} is in a block table"
            else:
                assert block.ref_cnt > 0, f"block {block.block_id} is neither free nor referenced"
                assert block.ref_cnt == holders.get(block.block_id, 0), (
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} but held by "
                    f"{holders.get(block.block_id, 0)} tables"
                )
        for block in self.uncached_free:
            assert block.block_hash is None, f"uncached free block {block.block_id} carries a hash"
        for block in self.evictable:
            assert block.block_hash is not None, f"evictable block {block.block_id} carries no hash"
            assert block.priority == DEFAULT_PRIORITY, f"block {block.block_id} of the policy's queue is not default"
        for block in self.retained_free:
            assert block.block_hash is not None, f"retained free block {block.block_id} carries no hash"
            assert block.priority != DEFAULT_PRIORITY, f"default block {block.block_id} is in the retained queue"
        assert self.num_marked == sum(b.priority != DEFAULT_PRIORITY for b in self.blocks), "num_marked is off"
        above = {b.block_id for b in self.blocks if b.priority > DEFAULT_PRIORITY}
        assert above == set(self.retained), "the retained share does not list exactly the blocks above default"
        assert len(above) <= self.max_retained_blocks, "retained blocks exceed the share"
        for block in self.blocks:
            assert block.priority == DEFAULT_PRIORITY or block.block_hash is not None, (
                f"uncached block {block.block_id} keeps priority {block.priority}"
            )
            assert block.priority != EXPIRED or block.ref_cnt == 0, f"block {block.block_id} in use is expired"
        for tenant, owned in self.retained_by_tenant.items():
            assert all(self.retained.get(i) is b and b.tenant == tenant for i, b in owned.items()), (
                f"tenant {tenant!r}'s retained blocks disagree with the share"
            )
            quota = self.max_tenant_retained_blocks
            assert quota is None or len(owned) <= quota, f"tenant {tenant!r} exceeds its quota"
        assert sum(map(len, self.retained_by_tenant.values())) == sum(
            b.tenant is not None for b in self.retained.values()
        ), "a tenant's retained block is missing from its table"
        indexed = 0
        for group, cached in enumerate(self.cached):
            for block_hash, entry in cached.items():
                members = [entry] if type(entry) is Block else list(entry.values())
                assert members, "empty hash entry"
                for block in members:
                    assert block.block_hash == block_hash, f"index entry points at block {block.block_id} wrongly"
                    assert block.group == group, f"block {block.block_id} is indexed in group {group}, not its own"
                indexed += len(members)
        assert indexed == sum(b.block_hash is not None for b in self.blocks), "a hashed block is not indexed"
