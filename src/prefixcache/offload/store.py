"""The interface every offload tier implements, its statistics and its events.

A block travels as ``bytes``: its K and V for every layer, C-contiguous ``[layers, 2, block_size, kv_heads,
head_dim]`` in the KV dtype (see :class:`~prefixcache.offload.record.KVLayout`). Bytes keep the tiers free of
torch, are what a file or Redis holds anyway, and cost one copy out of and into the device cache. A state
checkpoint of a model with recurrent layers travels the same way, under its block's
:func:`~prefixcache.offload.record.state_key`, with :attr:`~prefixcache.offload.record.KVLayout.state_bytes` of
payload: a store keeps and evicts it like a block, counting its own size.

Tiers are called from two threads: the scheduler looks blocks up and reads them, a background writer stores
them. Each store guards its index and statistics with its own lock.

A block stored under a retention directive comes with its ``(priority, seconds left)``: a tier evicts in the
device pool's order (expired first, then the lowest priority, least recently used within a priority;
:class:`RetentionOrder`), and a block whose time ran out is no longer held: it is never loaded. The time runs from
when the tier got the block (a tier's hit does not extend it), on the wall clock, since disk and Redis records
outlive the process.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, replace

from prefixcache.core.block_pool import Block
from prefixcache.core.eviction import EXPIRED, RetainedQueue
from prefixcache.core.hashing import BlockHash
from prefixcache.core.retention import DEFAULT_PRIORITY
from prefixcache.offload.record import BadRecord, KVLayout, RecordRetention, check_payload

logger = logging.getLogger(__name__)

# A block's retention as the connector hands it to a tier: (priority, seconds it has left).
Retention = tuple[int, float]


@dataclass(slots=True)
class TierStats:
    """One tier's counters since start. ``hits`` are blocks found (read and verified) at lookup;
    ``hit_tokens`` and ``blocks_loaded`` count what the connector then served from it into the device cache.
    ``bad_records`` are truncated, corrupt or foreign records (each a miss); ``errors`` failed I/O or
    connections."""

    medium: str
    capacity_bytes: int
    available: bool = True
    used_bytes: int = 0
    num_blocks: int = 0
    hits: int = 0
    hit_tokens: int = 0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    blocks_stored: int = 0
    bytes_stored: int = 0
    store_seconds: float = 0.0
    evictions: int = 0
    bad_records: int = 0
    errors: int = 0


def held_run(hashes: Sequence[BlockHash], held: Container[BlockHash]) -> int:
    """How many of ``hashes``, from the first, are in ``held``."""
    for i, block_hash in enumerate(hashes):
        if block_hash not in held:
            return i
    return len(hashes)


class RetentionOrder:
    """Which block a tier gives up next: the device pool's order, by reusing its :class:`RetainedQueue`.

    Blocks at the default priority are in an LRU list; the others each stand in the queue as a ``Block`` of their
    own, so that expired ones come first, then those below the default, then the default LRU, then the retained
    ones, lowest priority first, least recently used within one. Every operation is O(1) or O(log n).
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._default: OrderedDict[BlockHash, None] = OrderedDict()
        self._marked: dict[BlockHash, Block] = {}
        self._queue = RetainedQueue()
        self._ids = itertools.count()

    def add(self, block_hash: BlockHash, retention: RecordRetention | None = None) -> None:
        """A block the tier holds now, at the young end of its priority (kept until ``retention.expires_at``)."""
        self.remove(block_hash)
        if retention is None or retention.priority == DEFAULT_PRIORITY:
            self._default[block_hash] = None
            return
        now = self.clock()
        block = Block(next(self._ids), block_hash=block_hash, priority=retention.priority)
        block.ttl_s = retention.expires_at - now
        self._marked[block_hash] = block
        self._queue.push([block], now)

    def touch(self, block_hash: BlockHash) -> None:
        """A hit: the block moves to the young end of its priority; its expiry stays."""
        block = self._marked.get(block_hash)
        if block is None:
            self._default.move_to_end(block_hash)
        elif not self.expired(block_hash):
            self.add(block_hash, RecordRetention(block.priority, block.expires_at))

    def expired(self, block_hash: BlockHash) -> bool:
        """Whether the block's time ran out (it is still listed, first in line for eviction)."""
        block = self._marked.get(block_hash)
        return block is not None and (block.priority == EXPIRED or block.expires_at <= self.clock())

    def remove(self, block_hash: BlockHash) -> bool:
        """Forget the block; whether it was held."""
        if block_hash in self._default:
            del self._default[block_hash]
            return True
        block = self._marked.pop(block_hash, None)
        if block is None:
            return False
        self._queue.remove(block)
        block.priority = DEFAULT_PRIORITY  # its expiry entry, still in the queue's heap, is skipped from now on
        return True

    def pop(self) -> BlockHash | None:
        """Remove and return the block to evict next, None when empty."""
        self._queue.expire(self.clock())
        priorities = self._queue.priorities
        if priorities and (priorities[0] < DEFAULT_PRIORITY or not self._default):
            block = self._queue.pop_lowest()
            del self._marked[block.block_hash]
            block.priority = DEFAULT_PRIORITY
            return block.block_hash
        if self._default:
            return self._default.popitem(last=False)[0]
        return None


class TierEventListener:
    """Told when a tier gains or loses blocks, with the tier's medium ("CPU", "DISK", "REDIS"), so a router
    learns what each engine can load. Every method does nothing unless overridden."""

    def tier_blocks_stored(self, medium: str, block_hashes: list[BlockHash], block_size: int) -> None:
        """``block_hashes`` were written to the tier."""

    def tier_blocks_removed(self, medium: str, block_hashes: list[BlockHash]) -> None:
        """``block_hashes`` were evicted from (or dropped as unreadable by) the tier."""

    def tier_checkpoints_stored(self, medium: str, block_hashes: list[BlockHash], block_size: int) -> None:
        """State checkpoints were written to the tier, each at the end of the block of one of ``block_hashes``."""

    def tier_checkpoints_removed(self, medium: str, block_hashes: list[BlockHash]) -> None:
        """The tier no longer holds the checkpoints at the end of the blocks of ``block_hashes``."""


class KVStore(ABC):
    """A bounded store of blocks keyed by block hash, LRU within a priority (see the module docstring).

    ``load_prefix`` returns the payloads of the longest run of ``hashes``, from the first, that the store
    holds intact (``held_prefix`` only says which it holds); ``store`` writes blocks it does not hold yet,
    evicting the least recently used beyond the capacity. Neither raises for a failing medium: the store
    counts the failure, logs it once, and answers as a miss; a store that cannot work at all marks itself
    unavailable.
    """

    medium: str = ""
    persistent: bool = False  # outlives the process or is shared: gets every block as it is computed

    def __init__(self, layout: KVLayout, capacity_bytes: int, wall_clock: Callable[[], float] = time.time) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity must be positive, got {capacity_bytes} bytes")
        self.wall_clock = wall_clock
        self.layout = layout
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats(self.medium, capacity_bytes)
        self._lock = threading.Lock()
        self._listeners: list[TierEventListener] = []
        self._warned: set[str] = set()

    @property
    def available(self) -> bool:
        return self.stats.available

    def add_listener(self, listener: TierEventListener) -> None:
        self._listeners.append(listener)

    def snapshot(self) -> TierStats:
        with self._lock:
            return replace(self.stats)

    def load_prefix(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        if not hashes or not self.available:
            return []
        start = time.perf_counter()
        payloads = self._load_prefix(hashes)
        elapsed = time.perf_counter() - start
        with self._lock:
            self.stats.load_seconds += elapsed
            self.stats.hits += len(payloads)
            self.stats.bytes_loaded += sum(len(p) for p in payloads)
        return payloads

    def held_prefix(self, hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
        """The leading ``hashes`` the store holds, from its index alone: no record is read or verified (one
        that fails its check shows only when loaded), and neither the LRU order nor the statistics change."""
        if not hashes or not self.available:
            return []
        return hashes[: self._count_held(hashes)]

    def store(
        self, items: Sequence[tuple[BlockHash, bytes]], retention: Mapping[BlockHash, Retention] | None = None
    ) -> None:
        """Write ``items``; ``retention`` has the ``(priority, seconds left)`` of those a directive marked."""
        if not items or not self.available:
            return
        for key, payload in items:
            check_payload(self.layout, key, payload)
        start = time.perf_counter()
        kept: dict[BlockHash, RecordRetention] = {}
        if retention:
            now = self.wall_clock()
            kept = {h: RecordRetention(p, now + left) for h, (p, left) in retention.items() if p != DEFAULT_PRIORITY}
        stored, evicted = self._store(items, kept)
        elapsed = time.perf_counter() - start
        with self._lock:
            self.stats.store_seconds += elapsed
            self.stats.blocks_stored += len(stored)
            self.stats.bytes_stored += sum(map(self.layout.payload_bytes, stored))
            self.stats.evictions += len(evicted)
        self._emit(stored, evicted)

    def discard(self, hashes: Sequence[BlockHash]) -> None:
        """Drop blocks the store holds (a missing one is ignored); listeners hear of the removal."""
        if not hashes or not self.available:
            return
        removed = self._discard(hashes)
        self._emit([], removed)

    def count_served(self, num_blocks: int, num_tokens: int) -> None:
        """The connector loaded ``num_blocks`` of this tier's blocks into the device cache, serving ``num_tokens``."""
        with self._lock:
            self.stats.blocks_loaded += num_blocks
            self.stats.hit_tokens += num_tokens

    def close(self) -> None:
        """Release connections or handles; the store answers every call as a miss afterwards."""
        with self._lock:
            self.stats.available = False

    @abstractmethod
    def _load_prefix(self, hashes: Sequence[BlockHash]) -> list[bytes]: ...

    @abstractmethod
    def _count_held(self, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes``, from the first, the store holds; touches nothing."""

    @abstractmethod
    def _discard(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Drop the blocks held; returns those that were."""

    @abstractmethod
    def _store(
        self, items: Sequence[tuple[BlockHash, bytes]], retention: Mapping[BlockHash, RecordRetention]
    ) -> tuple[list[BlockHash], list[BlockHash]]:
        """Write the blocks not held yet (those in ``retention`` kept at its priority until its expiry); returns
        (hashes stored, hashes evicted)."""

    def _emit(self, stored: list[BlockHash], removed: list[BlockHash]) -> None:
        for listener in self._listeners:
            if stored:
                listener.tier_blocks_stored(self.medium, stored, self.layout.block_size)
            if removed:
                listener.tier_blocks_removed(self.medium, removed)

    def _count_bad(self, block_hash: BlockHash, bad: BadRecord, where: str) -> None:
        """A record that cannot be used is a miss: counted always, logged the first time per kind."""
        with self._lock:
            self.stats.bad_records += 1
        self._warn_once(
            bad.reason.value,
            "%s tier: block %s at %s is %s (%s); treated as a miss, later ones are only counted",
            self.medium,
            block_hash.hex()[:16],
            where,
            bad.reason.value,
            bad.detail,
        )

    def _count_error(self, kind: str, message: str, *args: object) -> None:
        with self._lock:
            self.stats.errors += 1
        self._warn_once(kind, message, *args)

    def _warn_once(self, kind: str, message: str, *args: object) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message, *args)
