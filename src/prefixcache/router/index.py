"""Which backend holds which block hash: the router's picture of every engine's prefix cache.

Fed from KV cache events (or, in the simulation, straight from each engine's block pool through
:class:`IndexListener`). Each copy of a hash is kept by medium (``GPU``, an offload tier) and KV cache
group, and a backend's longest cached prefix is predicted by the engine's own rule:

- one full-attention group (most models, and a backend whose events name no group): a hash is held while
  any copy is, and the chain of hashes makes the hit the longest run of a prompt's block hashes held from
  the first block on;
- several groups, or a sliding one (hybrid attention: Gemma 3, a windowed Qwen3 or Mistral): each group's spec comes
  from the backend's ``/v1/cache/config`` (:meth:`PrefixIndex.set_groups`, before any event) and from its
  events (:meth:`PrefixIndex.learn_group`, which win), and the hit is
  :func:`~prefixcache.core.kv_cache_groups.longest_common_hit` over what each group holds on ``GPU``, the
  very function the engine admits with, continued by the run of blocks its offload tiers hold from there
  (as the engine's connector continues it);
- a recurrent-state group (vLLM's ``mamba`` kind: Qwen3.5, Granite 4.0-H, LFM2), whose entries are state
  checkpoints on GPU and in the tiers (each under the hash of the block it ends): the hit is the longest prefix
  whose blocks every attention group holds (GPU, then the tiers' run) with a checkpoint (GPU or tier) at exactly
  its end, found by :func:`~prefixcache.core.kv_cache_groups.checkpoint_boundary` as the engine's cache manager
  finds it. A group of a kind no rule describes makes the predicted hit 0: the backend is routed by load.

Retention: a ``BlockStored`` event names each block's ``[priority, ttl_s]`` when a directive marked it, and the
index keeps it for the backend's GPU copy (:meth:`PrefixIndex.retention`): the engine evicts a retained block
only after every block of a lower priority, so of two backends that would serve the same hit, the one that holds
it retained keeps it longest, and a request routed there renews its TTL instead of warming a second, unretained
copy elsewhere (:class:`~prefixcache.router.policy.PrefixAware` breaks a tie of cost that way). The engine runs a
TTL from the block's last use; the index from when it heard of the block, so it never counts a block retained
longer than the engine does, and past that time the block counts at the default priority.

Events only tell what a backend has computed. A request routed there is about to compute its prompt's
blocks, so while it is in flight its hashes count as held too, in every group (``hold``/``release``): a
burst of one tenant's requests follows the first one instead of spreading before its events arrive.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

from prefixcache.core.block_pool import BlockPoolListener, StoredBlocks
from prefixcache.core.hashing import BlockHash
from prefixcache.core.kv_cache_groups import (
    FULL_ATTENTION,
    KVCacheGroupSpec,
    check_groups,
    checkpoint_boundary,
    longest_common_hit,
)
from prefixcache.core.retention import DEFAULT_PRIORITY
from prefixcache.router.wire import MEDIUM_GPU, external_block_hash

Copy = tuple[str, int]  # (medium, KV cache group)
_NO_COPIES: dict[str, set[Copy]] = {}
_NONE: frozenset[Copy] = frozenset()


@dataclass(slots=True)
class _Groups:
    """One backend's KV cache groups: as its config reported them and as its events say (events win); None is
    a kind the router cannot predict. ``specs`` and ``indices`` are what the prediction uses, in group order;
    ``single``: one full-attention group (or none known), where any copy serves a hit, today's plain path."""

    block_size: int
    reported: dict[int, KVCacheGroupSpec | None] = field(default_factory=dict)
    learned: dict[int, KVCacheGroupSpec | None] = field(default_factory=dict)
    indices: tuple[int, ...] = ()
    specs: tuple[KVCacheGroupSpec | None, ...] = ()
    single: bool = True

    def update(self) -> None:
        merged = self.reported | self.learned
        self.indices = tuple(sorted(merged))
        self.specs = tuple(merged[g] for g in self.indices)
        self.single = self.specs in ((), (FULL_ATTENTION,))


class PrefixIndex:
    """See the module docstring; ``clock`` (seconds) times the retention TTLs events name."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # backend -> hash -> (priority, until when) of its GPU copy, for hashes a directive marked
        self._retention: dict[str, dict[int, tuple[int, float]]] = {}
        self._holders: dict[int, dict[str, set[Copy]]] = {}  # hash -> backend -> copies holding it
        self._by_backend: dict[str, set[int]] = {}
        self._on_gpu: Counter[str] = Counter()  # backend -> distinct hashes it holds on GPU, in some group
        self._in_flight: dict[str, Counter[int]] = {}  # backend -> hashes of requests routed there, counted
        self._groups: dict[str, _Groups] = {}

    def __len__(self) -> int:
        """Distinct block hashes held anywhere (by events; in-flight requests' hashes are not counted)."""
        return len(self._holders)

    def num_blocks(self, backend: str) -> int:
        """Distinct hashes ``backend`` holds in some medium and group."""
        return len(self._by_backend.get(backend, ()))

    def gpu_blocks(self, backend: str) -> int:
        """Distinct hashes ``backend`` holds on ``GPU`` by events: how much of its own cache is in use, the same
        number in every router replica fed by the same events."""
        return self._on_gpu[backend]

    def holds(self, backend: str, block_hash: int, medium: str | None = None, group: int | None = None) -> bool:
        """Whether ``backend`` holds ``block_hash`` by events: on ``medium`` (None: any) in ``group`` (None: any)."""
        if medium is None and group is None:
            return block_hash in self._by_backend.get(backend, ())
        copies = self._holders.get(block_hash, _NO_COPIES).get(backend, ())
        return any(medium in (None, m) and group in (None, g) for m, g in copies)

    def set_groups(self, backend: str, block_size: int, groups: Sequence[KVCacheGroupSpec | None]) -> None:
        """What ``backend`` reports of its KV cache groups, in group order (None: a kind the router cannot
        predict), its blocks of ``block_size`` tokens; replaces what was known of them."""
        self._groups[backend] = record = _Groups(block_size, dict(enumerate(groups)))
        record.update()

    def learn_group(self, backend: str, group: int, spec: KVCacheGroupSpec | None, block_size: int) -> None:
        """What an event says of group ``group``; forgotten with the backend's entries (``clear``)."""
        record = self._groups.get(backend)
        if record is None:
            self._groups[backend] = record = _Groups(block_size)
        elif record.block_size == block_size and group in record.learned and record.learned[group] == spec:
            return
        record.block_size = block_size
        record.learned[group] = spec
        record.update()

    def store(
        self,
        backend: str,
        block_hashes: Iterable[int],
        medium: str = MEDIUM_GPU,
        group: int = 0,
        retention: Sequence[tuple[int, float | None]] | None = None,
    ) -> None:
        """``retention``: each block's ``(priority, ttl_s)`` as the event names it (None: no directive marked any)."""
        owned = self._by_backend.setdefault(backend, set())
        copy = (medium, group)
        on_gpu = medium == MEDIUM_GPU
        block_hashes = list(block_hashes)
        for block_hash in block_hashes:
            copies = self._holders.setdefault(block_hash, {}).setdefault(backend, set())
            if on_gpu and not _any_on_gpu(copies):
                self._on_gpu[backend] += 1
            copies.add(copy)
            owned.add(block_hash)
        if on_gpu and retention is not None:
            kept, now = self._retention.setdefault(backend, {}), self.clock()
            for block_hash, (priority, ttl_s) in zip(block_hashes, retention, strict=False):
                if priority != DEFAULT_PRIORITY and ttl_s is not None:
                    kept[block_hash] = (priority, now + ttl_s)

    def retention(self, backend: str, block_hash: int) -> int:
        """The priority ``backend``'s GPU copy of ``block_hash`` is kept at: a directive's until its TTL ends, the
        default before it was marked and after."""
        kept = self._retention.get(backend, {}).get(block_hash)
        if kept is None or kept[1] <= self.clock():
            return DEFAULT_PRIORITY
        return kept[0]

    def retained_run(self, backend: str, block_hashes: Sequence[int]) -> int:
        """How many of the leading ``block_hashes`` ``backend`` holds on GPU above the default priority, from the
        first: the part of its hit the engine evicts last."""
        kept = self._retention.get(backend)
        if not kept:
            return 0
        now = self.clock()
        for depth, block_hash in enumerate(block_hashes):
            entry = kept.get(block_hash)
            if entry is None or entry[0] <= DEFAULT_PRIORITY or entry[1] <= now:
                return depth
        return len(block_hashes)

    def remove(self, backend: str, block_hashes: Iterable[int], medium: str = MEDIUM_GPU, group: int = 0) -> None:
        """Forget ``medium``'s copy in ``group``; a hash unknown to the index (stored before we listened) is ignored."""
        copy = (medium, group)
        self._forget(backend, block_hashes, lambda copies: copies.discard(copy))

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
        """Drop what ``backend`` holds by events: on ``medium`` only, in every group (a reset clears the engine's
        own cache, not its offload tiers), or everywhere, with the groups its events taught (a restart, or
        it left the rotation); what its config reported of its groups stays."""
        if medium is not None:

            def drop_medium(copies: set[Copy]) -> None:
                copies.difference_update([c for c in copies if c[0] == medium])

            self._forget(backend, list(self._by_backend.get(backend, ())), drop_medium)
            return
        self._on_gpu.pop(backend, None)
        self._retention.pop(backend, None)
        for block_hash in self._by_backend.pop(backend, ()):
            holders = self._holders[block_hash]
            del holders[backend]
            if not holders:
                del self._holders[block_hash]
        record = self._groups.get(backend)
        if record is not None and record.learned:
            record.learned.clear()
            record.update()

    def matched_blocks(self, block_hashes: Sequence[int], backends: Iterable[str]) -> dict[str, int]:
        """For each backend, how many of the leading ``block_hashes`` (all hittable) its engine would find cached."""
        matched = dict.fromkeys(backends, 0)
        remaining = set()
        for backend in matched:
            record = self._groups.get(backend)
            if record is None or record.single:
                remaining.add(backend)
            else:
                matched[backend] = self._grouped_hit(backend, record, block_hashes)
        if not remaining:
            return matched
        for depth, block_hash in enumerate(block_hashes, start=1):
            holders = self._holders.get(block_hash, _NO_COPIES)
            remaining = {b for b in remaining if b in holders or block_hash in self._in_flight.get(b, ())}
            if not remaining:
                break
            for backend in remaining:
                matched[backend] = depth
        return matched

    def _grouped_hit(self, backend: str, record: _Groups, block_hashes: Sequence[int]) -> int:
        """The engine's hit of a backend with KV cache groups, as its cache manager finds it: what every group
        serves on GPU, continued by the run of blocks its tiers hold from there; with a recurrent-state group,
        from where the attention groups' GPU blocks end, up to the deepest checkpoint (GPU or tier) on the way."""
        if None in record.specs:
            return 0
        holders = self._holders
        in_flight = self._in_flight.get(backend, ())
        specs = cast(tuple[KVCacheGroupSpec, ...], record.specs)  # no None: checked above
        state_groups = {g for g, spec in zip(record.indices, specs, strict=True) if spec.recurrent_state}

        def copies(block_hash: int) -> set[Copy] | frozenset[Copy]:
            return holders.get(block_hash, _NO_COPIES).get(backend, _NONE)

        def on_gpu(group: int) -> Callable[[int], bool | None]:
            copy = (MEDIUM_GPU, group)
            return lambda block_hash: True if copy in copies(block_hash) or block_hash in in_flight else None

        def tier_run(start: int) -> int:
            """The blocks the tiers hold from ``start`` on (a tier record serves every attention group)."""
            end = start
            while end < len(block_hashes) and any(
                medium != MEDIUM_GPU and group not in state_groups for medium, group in copies(block_hashes[end])
            ):
                end += 1
            return end - start

        lookups = [on_gpu(g) for g in record.indices]
        num_blocks, block_size = len(block_hashes), record.block_size
        if not state_groups:
            k, _ = longest_common_hit(specs, lookups, block_hashes, num_blocks, block_size)
            return k + tier_run(k)
        attention = [g for g, spec in enumerate(specs) if not spec.recurrent_state]
        num_held, _ = longest_common_hit(
            [specs[g] for g in attention], [lookups[g] for g in attention], block_hashes, num_blocks, block_size
        )
        k, _ = longest_common_hit(specs, lookups, block_hashes, num_held, block_size)

        def has_checkpoint(block_hash: int) -> bool:
            return block_hash in in_flight or any(group in state_groups for _, group in copies(block_hash))

        return checkpoint_boundary(has_checkpoint, block_hashes, k, num_held + tier_run(num_held))

    def _forget(self, backend: str, block_hashes: Iterable[int], drop: Callable[[set[Copy]], None]) -> None:
        """Apply ``drop`` to ``backend``'s copies of each hash; a hash left without a copy is no longer held."""
        owned = self._by_backend.get(backend)
        for block_hash in block_hashes:
            holders = self._holders.get(block_hash)
            copies = holders.get(backend) if holders else None
            if copies is None:
                continue
            was_on_gpu = _any_on_gpu(copies)
            drop(copies)
            if was_on_gpu and not _any_on_gpu(copies):
                self._on_gpu[backend] -= 1
                self._retention.get(backend, {}).pop(block_hash, None)
            if not copies:
                del holders[backend]
                owned.discard(block_hash)
                if not holders:
                    del self._holders[block_hash]


def _any_on_gpu(copies: set[Copy]) -> bool:
    return any(medium == MEDIUM_GPU for medium, _ in copies)


class IndexListener(BlockPoolListener):
    """Feeds one engine's block pool changes into the index directly, as its events would (simulation);
    ``groups`` are the engine's KV cache groups."""

    def __init__(
        self, index: PrefixIndex, backend: str, groups: Sequence[KVCacheGroupSpec] = (FULL_ATTENTION,)
    ) -> None:
        self.index = index
        self.backend = backend
        self.groups = check_groups(groups)

    def blocks_stored(self, stored: StoredBlocks) -> None:
        self.index.learn_group(self.backend, stored.group, self.groups[stored.group], stored.block_size)
        hashes = [external_block_hash(h) for h in stored.block_hashes]
        self.index.store(self.backend, hashes, group=stored.group, retention=stored.retention)

    def blocks_removed(self, block_hashes: list[BlockHash], group: int) -> None:
        self.index.remove(self.backend, [external_block_hash(h) for h in block_hashes], group=group)

    def cache_cleared(self) -> None:
        self.index.clear(self.backend)
