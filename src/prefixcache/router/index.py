"""Which backend holds which block hash: the router's picture of every engine's prefix cache.

Fed from KV cache events (or, in the simulation, straight from each engine's block pool through
:class:`IndexListener`). A hash is held by a backend while any of its media (``GPU``, an offload tier)
holds it; the chain of hashes means a backend's longest cached prefix is the longest run of a
prompt's block hashes that it holds from the first block on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prefixcache.core.block_pool import BlockPoolListener, StoredBlocks
from prefixcache.core.hashing import BlockHash
from prefixcache.router.wire import MEDIUM_GPU, external_block_hash


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, dict[str, set[str]]] = {}  # hash -> backend -> media holding it
        self._by_backend: dict[str, set[int]] = {}

    def __len__(self) -> int:
        """Distinct block hashes held anywhere."""
        return len(self._holders)

    def num_blocks(self, backend: str) -> int:
        return len(self._by_backend.get(backend, ()))

    def store(self, backend: str, block_hashes: Iterable[int], medium: str = MEDIUM_GPU) -> None:
        owned = self._by_backend.setdefault(backend, set())
        for block_hash in block_hashes:
            self._holders.setdefault(block_hash, {}).setdefault(backend, set()).add(medium)
            owned.add(block_hash)

    def remove(self, backend: str, block_hashes: Iterable[int], medium: str = MEDIUM_GPU) -> None:
        """Forget ``medium``'s copy; a hash unknown to the index (stored before we listened) is ignored."""
        owned = self._by_backend.get(backend)
        for block_hash in block_hashes:
            holders = self._holders.get(block_hash)
            media = holders.get(backend) if holders else None
            if media is None:
                continue
            media.discard(medium)
            if not media:
                del holders[backend]
                owned.discard(block_hash)
                if not holders:
                    del self._holders[block_hash]

    def clear(self, backend: str) -> None:
        """Drop everything ``backend`` holds (reset, restart, or it left the rotation)."""
        for block_hash in self._by_backend.pop(backend, ()):
            holders = self._holders[block_hash]
            del holders[backend]
            if not holders:
                del self._holders[block_hash]

    def matched_blocks(self, block_hashes: Sequence[int], backends: Iterable[str]) -> dict[str, int]:
        """For each backend, how many of the leading ``block_hashes`` it holds without a gap."""
        matched = dict.fromkeys(backends, 0)
        remaining = set(matched)
        for depth, block_hash in enumerate(block_hashes, start=1):
            holders = self._holders.get(block_hash)
            if not holders:
                break
            remaining.intersection_update(holders)
            if not remaining:
                break
            for backend in remaining:
                matched[backend] = depth
        return matched


class IndexListener(BlockPoolListener):
    """Feeds one engine's block pool changes into the index directly, as its events would (simulation)."""

    def __init__(self, index: PrefixIndex, backend: str) -> None:
        self.index = index
        self.backend = backend

    def blocks_stored(self, stored: StoredBlocks) -> None:
        self.index.store(self.backend, [external_block_hash(h) for h in stored.block_hashes])

    def blocks_removed(self, block_hashes: list[BlockHash]) -> None:
        self.index.remove(self.backend, [external_block_hash(h) for h in block_hashes])

    def cache_cleared(self) -> None:
        self.index.clear(self.backend)
