"""Eviction policies: the order in which free blocks that still hold a cached prefix are reused."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import chain
from typing import TYPE_CHECKING, Protocol

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
