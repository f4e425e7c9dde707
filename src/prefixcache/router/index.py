"""Which backend holds which block hash: the router's picture of every engine's prefix cache.

Fed from KV cache events (or, in the simulation, straight from each engine's block pool through
:class:`IndexListener`). A hash is held by a backend while any of its media (``GPU``, an offload tier)
holds it; the chain of hashes means a backend's longest cached prefix is the longest run of a
prompt's block hashes that it holds from the first block on.

Events only tell what a backend has computed. A request routed there is about to compute its prompt's
blocks, so while it is in flight its hashes count as held too (``hold``/``release``): a burst of one
tenant's requests follows the first one instead of spreading before its events arrive.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from prefixcache.core.block_pool import BlockPoolListener, StoredBlocks
from prefixcache.core.hashing import BlockHash
from prefixcache.router.wire import MEDIUM_GPU, external_block_hash


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, dict[str, set[str]]] = {}  # hash -> backend -> media holding it
        self._by_backend: dict[str, set[int]] = {}
        self._in_flight: dict[str, Counter[int]] = {}  # backend -> hashes of requests routed there, counted

    def __len__(self) -> int:
        """Distinct block hashes held anywhere (by events; in-flight requests' hashes are not counted)."""
        return len(self._holders)

    def num_blocks(self, backend: str) -> int:
        return len(self._by_backend.get(backend, ()))

    def holds(self, backend: str, block_hash: int) -> bool:
        """Whether any medium of ``backend`` holds ``block_hash`` by events."""
        return block_hash in self._by_backend.get(backend, ())

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

    def hold(self, backend: str, block_hashes: Iterable[int]) -> None:
        """A request routed to ``backend`` will compute these blocks: count them as there until ``release``."""
        self._in_flight.setdefault(backend, Counter()).update(block_hashes)

    def release(self, backend: str, block_hashes: Iterable[int]) -> None:
        """The request that ``hold`` counted ended: from now on only events say what ``backend`` holds."""
        counts = self._in_flight[backend]
        for block_hash in block_hashes:
            if counts[block_hash] > 1:
                counts[block_hash] -= 1
            else:
                del counts[block_hash]

    def clear(self, backend: str, medium: str | None = None) -> None:
        """Drop what ``backend`` holds by events: on ``medium`` only (a reset clears the engine's own cache,
        not its offload tiers), or everywhere (a restart, or it left the rotation)."""
        if medium is not None:
            self.remove(backend, list(self._by_backend.get(backend, ())), medium)
            return
        for block_hash in self._by_backend.pop(backend, ()):
            holders = self._holders[block_hash]
            del holders[backend]
            if not holders:
                del self._holders[block_hash]

    def matched_blocks(self, block_hashes: Sequence[int], backends: Iterable[str]) -> dict[str, int]:
        """For each backend, how many of the leading ``block_hashes`` it holds (or is computing) without a gap."""
        matched = dict.fromkeys(backends, 0)
        remaining = set(matched)
        for depth, block_hash in enumerate(block_hashes, start=1):
            holders = self._holders.get(block_hash, {})
            remaining = {b for b in remaining if b in holders or block_hash in self._in_flight.get(b, ())}
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
