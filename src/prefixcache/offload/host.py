"""The host memory tier: a second, larger pool of blocks in this process, LRU within its byte budget."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from prefixcache.core.hashing import BlockHash
from prefixcache.offload.record import KVLayout
from prefixcache.offload.store import KVStore


class HostMemoryStore(KVStore):
    """Blocks as ``bytes`` in an ordered dict: a hit moves a block to the young end, eviction pops the old end.

    Nothing leaves the process, so records carry no checksum here. Reported to routers as medium "CPU",
    as vLLM names its host memory offload.
    """

    medium = "CPU"

    def __init__(self, layout: KVLayout, capacity_bytes: int) -> None:
        super().__init__(layout, capacity_bytes)
        self._blocks: OrderedDict[BlockHash, bytes] = OrderedDict()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def _load_prefix(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        out: list[bytes] = []
        with self._lock:
            blocks = self._blocks
            for block_hash in hashes:
                payload = blocks.get(block_hash)
                if payload is None:
                    break
                blocks.move_to_end(block_hash)
                out.append(payload)
        return out

    def _discard(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        with self._lock:
            removed = [h for h in hashes if self._blocks.pop(h, None) is not None]
            self.stats.num_blocks = len(self._blocks)
            self.stats.used_bytes = len(self._blocks) * self.layout.block_bytes
        return removed

    def _store(self, items: Sequence[tuple[BlockHash, bytes]]) -> tuple[list[BlockHash], list[BlockHash]]:
        stored: list[BlockHash] = []
        evicted: list[BlockHash] = []
        size = self.layout.block_bytes
        max_blocks = self.capacity_bytes // size
        if max_blocks == 0:
            return stored, evicted
        with self._lock:
            blocks = self._blocks
            for block_hash, payload in items:
                if block_hash in blocks:
                    blocks.move_to_end(block_hash)
                    continue
                if len(blocks) == max_blocks:
                    evicted.append(blocks.popitem(last=False)[0])
                blocks[block_hash] = payload
                stored.append(block_hash)
            self.stats.num_blocks = len(blocks)
            self.stats.used_bytes = len(blocks) * size
        return stored, evicted
