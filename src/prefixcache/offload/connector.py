"""The offload connector: the offload tiers seen from the scheduler, in the spirit of vLLM's KV connector.

Scheduler side, each admission: :meth:`OffloadConnector.extend_local_hit` takes the device cache's hit and
extends it with the consecutive following blocks the tiers hold (for the next block host, then disk, then
Redis are asked; the first that holds it supplies as many as it has), reading and verifying them at once,
so a block that vanishes or fails its checksum later can never be loaded as garbage. The scheduler
allocates device blocks for them like for new tokens, and :meth:`~OffloadConnector.update_state_after_alloc`
puts them into this step's plan. At the end of the step :meth:`~OffloadConnector.build_plan` hands the
worker an :class:`OffloadPlan`: blocks to copy out before anything overwrites them (write-back), blocks to
load before the forward pass, blocks to copy out after it (write-through).

Which blocks are saved follows the device pool, which the connector watches as a ``BlockPoolListener``.
Disk and Redis (persistent tiers) always get a block as soon as it is computed (write-through): they exist
to outlive the process and to share blocks with other engines, so they must not wait for an eviction. The
host memory tier follows ``mode``:

- ``write_back`` (default): the host tier gets a block when the device evicts its last copy, and gives it up
  when it is loaded back into the device. Device and host hold different blocks, so their capacities add
  up: on the Mooncake conversation trace, 1M device tokens plus a 10M-token host tier reach the hit rate of
  one 11M-token cache (0.3066), where write-through reaches 0.2973, that of a 10M cache (the host then
  also holds most of what the device holds). Only evicted blocks are copied out.
- ``write_through``: the host tier gets every block as it is computed, like the persistent tiers.

The writes go to a :class:`TierWriter` and never stall a step. Blocks served from a lower tier are promoted
into the write-through tiers above it from the bytes already read.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from prefixcache.core.block_pool import Block, BlockPoolListener, StoredBlocks
from prefixcache.core.hashing import BlockHash
from prefixcache.core.kv_cache_manager import KVCacheManager
from prefixcache.core.miss import hittable_blocks
from prefixcache.core.request import Request
from prefixcache.offload.store import KVStore, TierEventListener, TierStats

logger = logging.getLogger(__name__)
T = TypeVar("T")

WRITE_THROUGH = "write_through"
WRITE_BACK = "write_back"
OFFLOAD_MODES = (WRITE_BACK, WRITE_THROUGH)


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """Write ``payload`` (read from tier ``tier``) into device block ``block_id``."""

    block_id: int
    block_hash: BlockHash
    payload: bytes
    tier: int


@dataclass(frozen=True, slots=True)
class BlockSave:
    """Copy device block ``block_id`` out and store it under ``block_hash`` in the tiers ``tiers``."""

    block_id: int
    block_hash: BlockHash
    tiers: tuple[int, ...]


@dataclass(slots=True)
class OffloadPlan:
    """One step's transfers, in the order the worker does them around the forward pass."""

    save_before: list[BlockSave] = field(default_factory=list)
    loads: list[BlockLoad] = field(default_factory=list)
    save_after: list[BlockSave] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.save_before or self.loads or self.save_after)


@dataclass(slots=True)
class _Staged:
    """Blocks read for a request that has not been admitted yet, starting at block ``start``."""

    start: int
    tiers: list[int]
    payloads: list[bytes]


class TierWriter:
    """Stores blocks in the tiers, on a background thread so that saving never stalls a step.

    Batches wait in a bounded queue; when the tiers fall behind and the queue is full, a batch is dropped
    (counted): a dropped save is only a future miss. ``background=False`` writes at once (simulation).
    """

    def __init__(self, stores: Sequence[KVStore], background: bool = True, max_pending_batches: int = 64) -> None:
        self.stores = list(stores)
        self.dropped_batches = 0
        self._queue: queue.Queue[tuple[tuple[int, ...], list[tuple[BlockHash, bytes]]] | None] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(max_pending_batches)
            self._thread = threading.Thread(target=self._run, name="kv-offload-writer", daemon=True)
            self._thread.start()

    def submit(self, tiers: Sequence[int], items: list[tuple[BlockHash, bytes]]) -> None:
        if not items or not tiers:
            return
        if self._queue is None:
            self._write(tuple(tiers), items)
            return
        try:
            self._queue.put_nowait((tuple(tiers), items))
        except queue.Full:
            self.dropped_batches += 1

    def flush(self) -> None:
        """Wait until everything submitted so far is written."""
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._queue = self._thread = None

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            try:
                if batch is None:
                    return
                self._write(*batch)
            except Exception:  # a tier bug must not kill the writer: log it and keep serving
                logger.exception("KV offload writer: storing a batch failed")
            finally:
                self._queue.task_done()

    def _write(self, tiers: tuple[int, ...], items: list[tuple[BlockHash, bytes]]) -> None:
        for tier in tiers:
            self.stores[tier].store(items)


class OffloadConnector(BlockPoolListener, TierEventListener):
    """Scheduler side of the offload tiers for one :class:`KVCacheManager`; see the module docstring."""

    def __init__(
        self,
        manager: KVCacheManager,
        stores: Sequence[KVStore],
        mode: str = WRITE_BACK,
        writer: TierWriter | None = None,
    ) -> None:
        if mode not in OFFLOAD_MODES:
            raise ValueError(f"offload mode must be one of {', '.join(OFFLOAD_MODES)}, got {mode!r}")
        if not stores:
            raise ValueError("an offload connector needs at least one tier")
        for store in stores:
            if store.layout.block_size != manager.block_size:
                raise ValueError(
                    f"{store.medium} tier has blocks of {store.layout.block_size} tokens, "
                    f"the device cache {manager.block_size}"
                )
        self.manager = manager
        self.stores = list(stores)
        self.mode = mode
        back = [mode == WRITE_BACK and not store.persistent for store in self.stores]
        self._write_back_tiers = tuple(i for i, is_back in enumerate(back) if is_back)
        self._write_through_tiers = tuple(i for i, is_back in enumerate(back) if not is_back)
        self.writer = writer or TierWriter(self.stores)
        self.block_size = manager.block_size
        self._staged: dict[str, _Staged] = {}
        self._plan = OffloadPlan()
        self._loaded_this_step: set[BlockHash] = set()
        self._event_lock = threading.Lock()
        self._events: list[tuple[str, str, list[BlockHash], int]] = []
        self._listeners: list[TierEventListener] = []
        for store in self.stores:
            store.add_listener(self)
        manager.pool.add_listener(self)

    # ---- scheduler side -------------------------------------------------------------------------

    def extend_local_hit(self, request: Request, blocks: list[Block], num_cached: int) -> tuple[list[Block], int, int]:
        """The device hit ``(blocks, num_cached)`` extended by the tiers: ``(blocks, num_cached, num_external)``.

        The tiers continue from the last full device block. A device hit that ends in a partial block
        (a sub-block copy) is kept when the tiers cannot beat it, else dropped for the longer tier hit.
        """
        full = num_cached // self.block_size
        num_external = self.get_num_new_matched_tokens(request, full * self.block_size)
        if full * self.block_size + num_external > num_cached:
            return blocks[:full], full * self.block_size, num_external
        return blocks, num_cached, 0

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens the tiers hold right after the block-aligned ``num_computed_tokens``, read and verified.

        Leaves at least the last prompt token to compute. The blocks stay staged for this request until it
        is admitted (:meth:`update_state_after_alloc`) or finished.
        """
        if not self.manager.enable_caching or request.skip_reading_prefix_cache:
            return 0
        if num_computed_tokens % self.block_size:
            raise ValueError(f"num_computed_tokens must be block-aligned, got {num_computed_tokens}")
        start = num_computed_tokens // self.block_size
        staged = self._staged.get(request.request_id)
        if staged is None or staged.start != start or not staged.payloads:
            staged = _Staged(start, *self._run(self._hittable_after(request, start), KVStore.load_prefix))
            self._staged[request.request_id] = staged
        return len(staged.payloads) * self.block_size

    def lookup(self, request: Request, num_cached: int) -> dict[str, int]:
        """Where admitting ``request`` now would find its prefix, given the device's hit of ``num_cached``
        tokens: tokens per tier, ``device`` first, taken as :meth:`extend_local_hit` takes them.

        Only the tiers' indexes are asked (:meth:`KVStore.held_prefix`): no block is read, no tier's LRU
        order or statistics change, nothing is staged.
        """
        by_tier = {"device": num_cached} | dict.fromkeys((store.medium for store in self.stores), 0)
        if not self.manager.enable_caching or request.skip_reading_prefix_cache:
            return by_tier
        full = num_cached // self.block_size
        tiers, _ = self._run(self._hittable_after(request, full), KVStore.held_prefix)
        if (full + len(tiers)) * self.block_size > num_cached:
            by_tier["device"] = full * self.block_size
            for tier in tiers:
                by_tier[self.stores[tier].medium] += self.block_size
        return by_tier

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """The request was admitted with ``num_external_tokens`` from the tiers: load them into its blocks."""
        staged = self._staged.pop(request.request_id, None)
        num_blocks = num_external_tokens // self.block_size
        if num_blocks == 0:
            return
        if staged is None or len(staged.payloads) < num_blocks:
            raise ValueError(f"request {request.request_id!r}: {num_external_tokens} tier tokens were not looked up")
        hashes = self.manager.block_hashes(request)
        by_tier: dict[int, list[tuple[BlockHash, bytes]]] = {}
        for i in range(num_blocks):
            position = staged.start + i
            tier, payload, block_hash = staged.tiers[i], staged.payloads[i], hashes[position]
            self._plan.loads.append(BlockLoad(block_ids[position], block_hash, payload, tier))
            self._loaded_this_step.add(block_hash)
            by_tier.setdefault(tier, []).append((block_hash, payload))
        for tier, items in by_tier.items():
            store = self.stores[tier]
            store.count_served(len(items), len(items) * self.block_size)
            if tier in self._write_back_tiers:  # the device holds it now; it comes back when evicted
                store.discard([h for h, _ in items])
            self.writer.submit([t for t in self._write_through_tiers if t < tier], items)

    def request_finished(self, request: Request) -> None:
        """Drop whatever was read for a request that leaves without being admitted."""
        self._staged.pop(request.request_id, None)

    def build_plan(self) -> OffloadPlan:
        """This step's transfers for the worker; delivers the tiers' events to the listeners."""
        plan, self._plan = self._plan, OffloadPlan()
        if self._loaded_this_step:
            plan.save_after = [s for s in plan.save_after if s.block_hash not in self._loaded_this_step]
            self._loaded_this_step = set()
        self._deliver_events()
        return plan

    def add_listener(self, listener: TierEventListener) -> None:
        """Hear the tiers' BlockStored / BlockRemoved, on the scheduler thread, when each step is planned."""
        self._listeners.append(listener)

    def stats(self) -> list[TierStats]:
        return [store.snapshot() for store in self.stores]

    def close(self) -> None:
        self.writer.close()
        for store in self.stores:
            store.close()

    def _hittable_after(self, request: Request, start: int) -> list[BlockHash]:
        """The request's block hashes from block ``start`` on that a hit may cover (not the last token's)."""
        return self.manager.block_hashes(request)[start : hittable_blocks(request.num_tokens, self.block_size)]

    def _run(
        self, hashes: Sequence[BlockHash], take: Callable[[KVStore, Sequence[BlockHash]], Sequence[T]]
    ) -> tuple[list[int], list[T]]:
        """The longest run of ``hashes`` the tiers hold, as ``take`` finds a tier's leading blocks (their
        payloads, or only their hashes): each block's tier, and what ``take`` gave for it. Each run starts in
        the first tier that holds the next block and takes as many consecutive blocks as that tier has (already
        read: no second look upward)."""
        tiers: list[int] = []
        found: list[T] = []
        while len(found) < len(hashes):
            for tier, store in enumerate(self.stores):
                more = take(store, hashes[len(found) :])
                if more:
                    tiers += [tier] * len(more)
                    found += more
                    break
            else:
                break
        return tiers, found

    # ---- device pool listener: what to save --------------------------------------------------------

    def blocks_stored(self, stored: StoredBlocks) -> None:
        tiers = self._write_through_tiers
        if tiers:
            get_cached = self.manager.pool.get_cached_block
            self._plan.save_after.extend(BlockSave(get_cached(h).block_id, h, tiers) for h in stored.block_hashes)

    def block_reused(self, block: Block) -> None:
        tiers = self._write_back_tiers
        if tiers and block.block_hash is not None and self.manager.pool.get_cached_block(block.block_hash) is None:
            self._plan.save_before.append(BlockSave(block.block_id, block.block_hash, tiers))  # the last copy

    # ---- tier events ---------------------------------------------------------------------------

    def tier_blocks_stored(self, medium: str, block_hashes: list[BlockHash], block_size: int) -> None:
        with self._event_lock:
            self._events.append(("stored", medium, block_hashes, block_size))

    def tier_blocks_removed(self, medium: str, block_hashes: list[BlockHash]) -> None:
        with self._event_lock:
            self._events.append(("removed", medium, block_hashes, 0))

    def _deliver_events(self) -> None:
        with self._event_lock:
            events, self._events = self._events, []
        for kind, medium, block_hashes, block_size in events:
            for listener in self._listeners:
                if kind == "stored":
                    listener.tier_blocks_stored(medium, block_hashes, block_size)
                else:
                    listener.tier_blocks_removed(medium, block_hashes)
