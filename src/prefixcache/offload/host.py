"""The host memory tier: a second, larger pool of blocks in this process, evicting in the device pool's order."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from prefixcache.core.hashing import BlockHash
from prefixcache.offload.record import KVLayout, RecordRetention
from prefixcache.offload.store import KVStore, RetentionOrder, held_run


class HostMemoryStore(KVStore):
    """Blocks as ``bytes`` in a dict, their eviction order in a :class:`RetentionOrder`: a hit moves a block to
    the young end of its priority; eviction takes an expired block first, then the lowest priority, least
    recently used within it, so a retained block demoted from the device outlives the default ones here too.

    Nothing leaves the process, so records carry no checksum here. Reported to routers as medium "CPU",
    as vLLM names its host memory offload.
    """

    medium = "CPU"

    def __init__(self, layout: KVLayout, capacity_bytes: int, wall_clock: Callable[[], float] = time.time) -> None:
        super().__init__(layout, capacity_bytes, wall_clock)
        self._blocks: dict[BlockHash, bytes] = {}
        self._used_bytes = 0  # blocks and state checkpoints differ in size
        self._order = RetentionOrder(self.wall_clock)

    def __contains__(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._blocks and not self._order.expired(block_hash)

    def _load_prefix(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        out: list[bytes] = []
        with self._lock:
            blocks, order = self._blocks, self._order
            for block_hash in hashes:
                payload = blocks.get(block_hash)
                if payload is None or order.expired(block_hash):
                    break
                order.touch(block_hash)
                out.append(payload)
        return out

    def _count_held(self, hashes: Sequence[BlockHash]) -> int:
        with self._lock:
            held = held_run(hashes, self._blocks)
            return next((i for i, h in enumerate(hashes[:held]) if self._order.expired(h)), held)

    def _discard(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        with self._lock:
            removed = []
            for block_hash in hashes:
                payload = self._blocks.pop(block_hash, None)
                if payload is not None and self._order.remove(block_hash):
                    self._used_bytes -= len(payload)
                    removed.append(block_hash)
            self._count()
        return removed

    def _store(
        self, items: Sequence[tuple[BlockHash, bytes]], retention: Mapping[BlockHash, RecordRetention]
    ) -> tuple[list[BlockHash], list[BlockHash]]:
        stored: list[BlockHash] = []
        evicted: list[BlockHash] = []
        with self._lock:
            blocks, order = self._blocks, self._order
            for block_hash, payload in items:
                if block_hash in blocks and not order.expired(block_hash):
                    order.touch(block_hash)
                    continue
                if len(payload) > self.capacity_bytes:
                    continue
                expired = blocks.pop(block_hash, None)  # its time ran out: replaced in place
                if expired is not None:
                    order.remove(block_hash)
                    self._used_bytes -= len(expired)
                used = self._used_bytes
                while used + len(payload) > self.capacity_bytes:
                    victim = order.pop()
                    used -= len(blocks.pop(victim))
                    evicted.append(victim)
                blocks[block_hash] = payload
                self._used_bytes = used + len(payload)
                order.add(block_hash, retention.get(block_hash))
                stored.append(block_hash)
            self._count()
        return stored, evicted

    def _count(self) -> None:
        self.stats.num_blocks = len(self._blocks)
        self.stats.used_bytes = self._used_bytes
