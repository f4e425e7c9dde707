"""Eviction policies: the order in which free blocks that still hold a cached prefix are reused."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from prefixcache.core.block_pool import Block


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


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUEvictionPolicy}


def make_eviction_policy(name: str | EvictionPolicy) -> EvictionPolicy:
    """A new policy from its registered name; a policy object (e.g. an offline oracle) is used as it is."""
    if not isinstance(name, str):
        return name
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(EVICTION_POLICIES)}") from None
