"""The interface every offload tier implements, its statistics and its events.

A block travels as ``bytes``: its K and V for every layer, C-contiguous ``[layers, 2, block_size, kv_heads,
head_dim]`` in the KV dtype (see :class:`~prefixcache.offload.record.KVLayout`). Bytes keep the tiers free of
torch, are what a file or Redis holds anyway, and cost one copy out of and into the device cache.

Tiers are called from two threads: the scheduler looks blocks up and reads them, a background writer stores
them. Each store guards its index and statistics with its own lock.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace

from prefixcache.core.hashing import BlockHash
from prefixcache.offload.record import BadRecord, KVLayout

logger = logging.getLogger(__name__)


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


class TierEventListener:
    """Told when a tier gains or loses blocks, with the tier's medium ("CPU", "DISK", "REDIS"), so a router
    learns what each engine can load. Every method does nothing unless overridden."""

    def tier_blocks_stored(self, medium: str, block_hashes: list[BlockHash], block_size: int) -> None:
        """``block_hashes`` were written to the tier."""

    def tier_blocks_removed(self, medium: str, block_hashes: list[BlockHash]) -> None:
        """``block_hashes`` were evicted from (or dropped as unreadable by) the tier."""


class KVStore(ABC):
    """A bounded store of blocks keyed by block hash, LRU within the store.

    ``load_prefix`` returns the payloads of the longest run of ``hashes``, from the first, that the store
    holds intact; ``store`` writes blocks it does not hold yet, evicting the least recently used beyond the
    capacity. Neither raises for a failing medium: the store counts the failure, logs it once, and answers
    as a miss; a store that cannot work at all marks itself unavailable.
    """

    medium: str = ""
    persistent: bool = False  # outlives the process or is shared: gets every block as it is computed

    def __init__(self, layout: KVLayout, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity must be positive, got {capacity_bytes} bytes")
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

    def store(self, items: Sequence[tuple[BlockHash, bytes]]) -> None:
        if not items or not self.available:
            return
        for _, payload in items:
            if len(payload) != self.layout.block_bytes:
                raise ValueError(f"payload has {len(payload)} bytes, the layout needs {self.layout.block_bytes}")
        start = time.perf_counter()
        stored, evicted = self._store(items)
        elapsed = time.perf_counter() - start
        with self._lock:
            self.stats.store_seconds += elapsed
            self.stats.blocks_stored += len(stored)
            self.stats.bytes_stored += len(stored) * self.layout.block_bytes
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
    def _discard(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Drop the blocks held; returns those that were."""

    @abstractmethod
    def _store(self, items: Sequence[tuple[BlockHash, bytes]]) -> tuple[list[BlockHash], list[BlockHash]]:
        """Write the blocks not held yet; returns (hashes stored, hashes evicted)."""

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
