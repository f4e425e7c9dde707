"""Eviction policies: the order in which free blocks that still hold a cached prefix are reused.

Blocks at the default priority are ordered by the pool's policy (LRU or ARC); blocks a retention directive gave
another priority wait in a :class:`RetainedQueue` beside it, so that without directives nothing changes.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import TYPE_CHECKING, Protocol

from prefixcache.core.retention import DEFAULT_PRIORITY

if TYPE_CHECKING:
    from prefixcache.core.block_pool import Block
    from prefixcache.core.hashing import BlockHash


class EvictionPolicy(Protocol):
    """The free queue of cached blocks. Every operation is O(1) (amortised) on the hot path."""

    def push(self, block: Block) -> None:
        """A cached block's last reference was dropped: it becomes a candidate for eviction."""

    def pop(self) -> Block:
        """Remove and return the block to evict next."""

    def remove(self, block: Block) -> None:
        """A free cached block was hit: it leaves the queue."""

    def clear(self) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Block]: ...


class LRUEvictionPolicy:
    """Least recently freed first; a C-implemented OrderedDict gives O(1) removal from the middle.

    Callers free a request's blocks tail first, so within one request the longest prefix (least
    likely to be shared) goes before its parents.
    """

    def __init__(self) -> None:
        self._queue: OrderedDict[int, Block] = OrderedDict()

    def push(self, block: Block) -> None:
        self._queue[block.block_id] = block

    def pop(self) -> Block:
        return self._queue.popitem(last=False)[1]

    def remove(self, block: Block) -> None:
        del self._queue[block.block_id]

    def clear(self) -> None:
        self._queue.clear()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Block]:
        return iter(self._queue.values())


class AdaptiveEvictionPolicy:
    """ARC (Megiddo and Modha, FAST '03) on the free queue: prefixes freed once versus freed again.

    Two LRU lists: blocks whose prefix has been freed once and blocks whose prefix was freed again
    (used by two or more requests, counted across evictions), plus ghost lists of the hashes recently
    evicted from each. Evicting from the once list first keeps one-off prompts from pushing reused
    prefixes out (on the Mooncake conversation trace 24% of blocks used once are used again, 42% of
    those used twice); a prefix filled again soon after its eviction shows which list evicted too
    early and moves the target length of the once list towards it, so a large cache stops guarding
    stale reused prefixes against fresh ones. Losing a reused prefix weighs ``REUSED_GHOST_WEIGHT``
    times as much, and each ghost list holds ``GHOST_FACTOR`` times the largest free queue seen;
    both measured on the Mooncake traces (docs/eviction.md).
    """

    REUSED_GHOST_WEIGHT = 2.0
    GHOST_FACTOR = 2

    def __init__(self) -> None:
        self._once: OrderedDict[int, Block] = OrderedDict()
        self._reused: OrderedDict[int, Block] = OrderedDict()
        self._once_ghost: OrderedDict[BlockHash, int] = OrderedDict()  # evicted hash -> its use count
        self._reused_ghost: OrderedDict[BlockHash, int] = OrderedDict()
        self._uses: dict[int, int] = {}  # block id -> times its cached prefix was freed, history included
        self._target = 0.0  # how long the once list may grow before the reused list gives up blocks
        self._largest = 0

    def push(self, block: Block) -> None:
        uses = self._uses.get(block.block_id)
        if uses is None:  # first free since the block was filled: the prefix may have been evicted lately
            uses = self._recall(block.block_hash)
        uses += 1
        self._uses[block.block_id] = uses
        (self._once if uses == 1 else self._reused)[block.block_id] = block
        self._largest = max(self._largest, len(self._once) + len(self._reused))

    def _recall(self, block_hash: BlockHash) -> int:
        """The prefix's use count before its eviction; a ghost hit moves the target towards its list."""
        uses = self._once_ghost.pop(block_hash, None)
        if uses is not None:
            step = max(1.0, len(self._reused_ghost) / max(1, len(self._once_ghost)))
            self._target = min(float(self._largest), self._target + step)
            return uses
        uses = self._reused_ghost.pop(block_hash, None)
        if uses is not None:
            step = max(1.0, len(self._once_ghost) / max(1, len(self._reused_ghost)))
            self._target = max(0.0, self._target - self.REUSED_GHOST_WEIGHT * step)
            return uses
        return 0

    def pop(self) -> Block:
        if self._once and (len(self._once) > self._target or not self._reused):
            queue, ghost = self._once, self._once_ghost
        else:
            queue, ghost = self._reused, self._reused_ghost
        block_id, block = queue.popitem(last=False)
        ghost[block.block_hash] = self._uses.pop(block_id)
        if len(ghost) > self.GHOST_FACTOR * self._largest:
            ghost.popitem(last=False)
        return block

    def remove(self, block: Block) -> None:
        if self._once.pop(block.block_id, None) is None:
            del self._reused[block.block_id]

    def clear(self) -> None:
        for table in (self._once, self._reused, self._once_ghost, self._reused_ghost, self._uses):
            table.clear()
        self._target = 0.0

    def __len__(self) -> int:
        return len(self._once) + len(self._reused)

    def __iter__(self) -> Iterator[Block]:
        return chain(self._once.values(), self._reused.values())


# The level of free blocks whose TTL ended while they were free: below every priority, evicted first, oldest
# expiry first. A block leaving it (hit or evicted) is back at the default priority.
EXPIRED = -1


class RetainedQueue:
    """The free cached blocks whose priority is not the default: one LRU list per priority in use (``EXPIRED``
    included), a sorted list of those priorities and a heap of expiries with lazy deletion.

    Every operation is O(1) or O(log n): at most 102 priorities exist, so finding the lowest one in use is a
    bounded list operation; a block's expiry is pushed when it is freed (its TTL runs from its last use; the
    blocks a request frees together with one TTL share an entry), and a block that no longer matches its entry
    (hit, demoted or evicted since) is skipped when the entry comes up. The heap is rebuilt from the live blocks
    when stale ones outnumber them fourfold, so a hot block freed again and again under a long TTL cannot grow it
    without bound.
    """

    def __init__(self) -> None:
        self._levels: dict[int, OrderedDict[int, Block]] = {}
        # Sorted: the levels that hold a block. A list, so the pool's hot paths test "any block here?" at C speed.
        self.priorities: list[int] = []
        # (expiry, order, the blocks freed together that expire then): one entry per request freed, not per block.
        self._expiries: list[tuple[float, int, tuple[Block, ...]]] = []
        self._num_expiring = 0  # blocks listed in the heap, stale ones included
        self._order = itertools.count()
        self._len = 0

    def push(self, blocks: Sequence[Block], now: float) -> None:
        """Blocks not at the default priority were freed at ``now``, in eviction order: each expires its
        ``ttl_s`` later."""
        expiring: dict[float, list[Block]] = {}
        levels = self._levels
        priority = ttl_s = None
        for block in blocks:  # a request's blocks mostly share a priority and a TTL: look each up once a run
            if block.priority != priority:
                priority = block.priority
                level = levels.get(priority)
                if level is None:
                    level = levels[priority] = OrderedDict()
                    bisect.insort(self.priorities, priority)
            level[block.block_id] = block
            if block.ttl_s != ttl_s:
                ttl_s = block.ttl_s
                expires_at = now + ttl_s
                same = expiring.setdefault(expires_at, [])
            block.expires_at = expires_at
            same.append(block)
        self._len += len(blocks)
        for expires_at, same in expiring.items():
            heapq.heappush(self._expiries, (expires_at, next(self._order), tuple(same)))
            self._num_expiring += len(same)
        if self._num_expiring > 4 * self._len + 1024:
            self._compact()

    def remove(self, block: Block) -> None:
        """A free block leaves the queue (it was hit or demoted)."""
        level = self._levels[block.priority]
        del level[block.block_id]
        self._len -= 1
        if not level:
            self._drop_level(block.priority)

    def pop_lowest(self) -> Block:
        """Remove and return the least recently freed block of the lowest priority."""
        priority = self.priorities[0]
        level = self._levels[priority]
        block = level.popitem(last=False)[1]
        self._len -= 1
        if not level:
            self._drop_level(priority)
        return block

    def next_expiry(self) -> float | None:
        """When the earliest live expiry here may fall (a stale entry may make it early, never late)."""
        return self._expiries[0][0] if self._expiries else None

    def expire(self, now: float) -> list[tuple[Block, int]]:
        """Move every block whose TTL ended by ``now`` to the ``EXPIRED`` level, in order of expiry; returns each
        with the priority it had."""
        expired: list[tuple[Block, int]] = []
        heap = self._expiries
        while heap and heap[0][0] <= now:
            expires_at, _, blocks = heapq.heappop(heap)
            self._num_expiring -= len(blocks)
            for block in blocks:
                priority = block.priority
                if block.ref_cnt or priority in (EXPIRED, DEFAULT_PRIORITY) or block.expires_at != expires_at:
                    continue  # hit, demoted, evicted or freed again since this entry was pushed
                self.remove(block)
                block.priority = EXPIRED
                self._append(block)
                expired.append((block, priority))
        return expired

    def clear(self) -> None:
        self._levels.clear()
        self.priorities.clear()
        self._expiries.clear()
        self._num_expiring = 0
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        """The blocks in eviction order among themselves (lowest priority first, LRU within one)."""
        return chain.from_iterable(self._levels[p].values() for p in self.priorities)

    def _append(self, block: Block) -> None:
        level = self._levels.get(block.priority)
        if level is None:
            level = self._levels[block.priority] = OrderedDict()
            bisect.insort(self.priorities, block.priority)
        level[block.block_id] = block
        self._len += 1

    def _drop_level(self, priority: int) -> None:
        del self._levels[priority]
        del self.priorities[bisect.bisect_left(self.priorities, priority)]

    def _compact(self) -> None:
        """Rebuild the heap from the live blocks, one entry per expiry time."""
        expiring: dict[float, list[Block]] = {}
        for priority, level in self._levels.items():
            if priority != EXPIRED:
                for block in level.values():
                    expiring.setdefault(block.expires_at, []).append(block)
        self._expiries = [(expires_at, next(self._order), tuple(same)) for expires_at, same in expiring.items()]
        self._num_expiring = self._len - len(self._levels.get(EXPIRED, ()))
        heapq.heapify(self._expiries)


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUEvictionPolicy,
    "arc": AdaptiveEvictionPolicy,
}


def make_eviction_policy(name: str | EvictionPolicy) -> EvictionPolicy:
    """A new policy from its registered name; a policy object (e.g. an offline oracle) is used as it is."""
    if not isinstance(name, str):
        return name
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(EVICTION_POLICIES)}") from None
