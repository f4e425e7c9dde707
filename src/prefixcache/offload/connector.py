"""The offload connector: the offload tiers seen from the cache manager, in the spirit of vLLM's KV connector.

It is the manager's :class:`~prefixcache.core.kv_cache_manager.KVConnector`, given to it at construction.
Each admission: :meth:`OffloadConnector.extend_hit` extends the device cache's hit with the consecutive
following blocks the tiers hold (for the next block host, then disk, then Redis are asked; the first that
holds it supplies as many as it has), reading and verifying them at once, so a block that vanishes or fails
its checksum later can never be loaded as garbage. The manager allocates device blocks for them like for
new tokens, and :meth:`~OffloadConnector.admitted` puts them into this step's plan. At the end of the
schedule :meth:`~OffloadConnector.take_plan` hands the worker an :class:`OffloadPlan`: blocks to copy out
before anything overwrites them (write-back), blocks to load before the forward pass, blocks to copy out
after it (write-through).

A tier record holds one block hash's K/V for every layer, whatever KV cache group a layer is in, so it
serves a hit in every group: a load names the block of each group it goes to (none for a sliding group
whose window does not reach it), a save the block of each group it is read from. With more than one
group a block is saved when its first group computes it (write-through): by the time a group evicts its
copy, a sliding group has long given its copy back, so the host tier cannot wait for evictions.

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

A model with recurrent layers also needs the state at a hit's end: the tiers keep state checkpoints as records of
their own under each checkpoint's block hash (:func:`~prefixcache.offload.record.state_key`), filled as blocks are:
the write-through tiers get each checkpoint when the forward pass saves it, the write-back host tier gets it when the
device's checkpoint budget evicts it (with its block's retention, as a block is demoted). A checkpoint read for a
hit is loaded straight into the request's working state (the tier keeps it: no device checkpoint holds it then).

The writes go to a :class:`TierWriter` and never stall a step. Blocks served from a lower tier are promoted
into the write-through tiers above it from the bytes already read.

Retention: a block a directive marked goes to the tiers with its priority and the time it has left, so each tier
evicts in the device pool's order and stops serving it when the time runs out (see
:mod:`prefixcache.offload.store`). Written through when computed, it has its whole TTL (``prompt_cache_retention:
"24h"`` keeps it 24 hours on disk or in Redis); demoted at eviction (write-back), what is left of the TTL the
device pool ran from its last use; an expired block is demoted at the default priority. With ``min_priority`` (the
TensorRT-LLM semantics of ``--kv-offload-min-priority``) a block or checkpoint whose priority is below it is
dropped where it would go to a tier, written through or demoted: only what a directive keeps is worth a tier.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from prefixcache.core.block_pool import Block, BlockPoolListener, StoredBlocks
from prefixcache.core.eviction import EXPIRED
from prefixcache.core.hashing import BlockHash
from prefixcache.core.kv_cache_groups import FULL_ATTENTION, KVCacheGroupSpec, check_groups
from prefixcache.core.kv_cache_manager import BlockTargets
from prefixcache.core.request import Request
from prefixcache.core.retention import DEFAULT_PRIORITY
from prefixcache.offload.record import is_state_key, state_block_hash, state_key
from prefixcache.offload.store import KVStore, Retention, TierEventListener, TierStats

logger = logging.getLogger(__name__)
T = TypeVar("T")

WRITE_THROUGH = "write_through"
WRITE_BACK = "write_back"
OFFLOAD_MODES = (WRITE_BACK, WRITE_THROUGH)


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """Write ``payload`` (read from tier ``tier``) into device blocks ``block_ids``, one a KV cache group: each
    group's layers go to its block (a group whose id is None does not need them)."""

    block_ids: BlockTargets
    block_hash: BlockHash
    payload: bytes
    tier: int


@dataclass(frozen=True, slots=True)
class BlockSave:
    """Copy out device blocks ``block_ids`` (each group's layers from its block) and store them under
    ``block_hash`` in the tiers ``tiers``, with ``retention``'s (priority, seconds left) when a directive marked
    it."""

    block_ids: tuple[int, ...]
    block_hash: BlockHash
    tiers: tuple[int, ...]
    retention: Retention | None = None


@dataclass(frozen=True, slots=True)
class StateLoad:
    """Write ``payload``, a checkpoint read from tier ``tier`` under ``key``, into working state slot ``slot``."""

    slot: int
    key: BlockHash
    payload: bytes
    tier: int


@dataclass(frozen=True, slots=True)
class StateSave:
    """Copy out state slot ``slot`` (a checkpoint) and store it under ``key`` (its block's
    :func:`~prefixcache.offload.record.state_key`) in the tiers ``tiers``, with ``retention`` as :class:`BlockSave`."""

    slot: int
    key: BlockHash
    tiers: tuple[int, ...]
    retention: Retention | None = None


@dataclass(slots=True)
class OffloadPlan:
    """One step's transfers, in the order the worker does them around the forward pass (blocks, then states)."""

    save_before: list[BlockSave] = field(default_factory=list)
    loads: list[BlockLoad] = field(default_factory=list)
    save_after: list[BlockSave] = field(default_factory=list)
    state_save_before: list[StateSave] = field(default_factory=list)
    state_loads: list[StateLoad] = field(default_factory=list)
    state_save_after: list[StateSave] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.save_before
            or self.loads
            or self.save_after
            or self.state_save_before
            or self.state_loads
            or self.state_save_after
        )


# What the writer's queue holds: tiers, blocks, the retention of those a directive marked.
_Batch = tuple[tuple[int, ...], list[tuple[BlockHash, bytes]], dict[BlockHash, Retention] | None]


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
        self._queue: queue.Queue[_Batch | None] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(max_pending_batches)
            self._thread = threading.Thread(target=self._run, name="kv-offload-writer", daemon=True)
            self._thread.start()

    def submit(
        self,
        tiers: Sequence[int],
        items: list[tuple[BlockHash, bytes]],
        retention: dict[BlockHash, Retention] | None = None,
    ) -> None:
        """Store ``items`` in ``tiers``; ``retention``: the (priority, seconds left) of those a directive marked."""
        if not items or not tiers:
            return
        if self._queue is None:
            self._write(tuple(tiers), items, retention)
            return
        try:
            self._queue.put_nowait((tuple(tiers), items, retention))
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

    def _write(
        self, tiers: tuple[int, ...], items: list[tuple[BlockHash, bytes]], retention: dict[BlockHash, Retention] | None
    ) -> None:
        for tier in tiers:
            self.stores[tier].store(items, retention)


class OffloadConnector(BlockPoolListener, TierEventListener):
    """Scheduler side of the offload tiers for one cache manager; see the module docstring.

    ``groups`` are the cache's KV cache groups; ``tier_listeners`` hear the tiers' events (KV events);
    ``clock`` is the device pool's, which the expiry of an evicted block is on; blocks below ``min_priority`` never
    go to a tier (an expired block counts at the default priority).
    """

    def __init__(
        self,
        stores: Sequence[KVStore],
        block_size: int,
        mode: str = WRITE_BACK,
        writer: TierWriter | None = None,
        groups: Sequence[KVCacheGroupSpec] = (FULL_ATTENTION,),
        tier_listeners: Sequence[TierEventListener] = (),
        clock: Callable[[], float] = time.monotonic,
        min_priority: int = 0,
    ) -> None:
        if mode not in OFFLOAD_MODES:
            raise ValueError(f"offload mode must be one of {', '.join(OFFLOAD_MODES)}, got {mode!r}")
        if not stores:
            raise ValueError("an offload connector needs at least one tier")
        for store in stores:
            if store.layout.block_size != block_size:
                raise ValueError(
                    f"{store.medium} tier has blocks of {store.layout.block_size} tokens, the device cache {block_size}"
                )
        groups = check_groups(groups)
        if mode == WRITE_BACK and len(groups) > 1:
            raise ValueError(
                f"write_back needs one KV cache group, this cache has {len(groups)}: use write_through "
                "(see the module docstring)"
            )
        self.stores = list(stores)
        self.block_size = block_size
        self.mode = mode
        back = [mode == WRITE_BACK and not store.persistent for store in self.stores]
        self._write_back_tiers = tuple(i for i, is_back in enumerate(back) if is_back)
        self._write_through_tiers = tuple(i for i, is_back in enumerate(back) if not is_back)
        # A block is saved when it is new to this group: full attention keeps every block longest.
        self._saving_group = next((g for g, spec in enumerate(groups) if spec.sliding_window is None), 0)
        self.writer = writer or TierWriter(self.stores)
        self._staged: dict[str, _Staged] = {}
        self._staged_states: dict[str, tuple[BlockHash, int, bytes]] = {}  # request id -> (key, tier, payload)
        self._plan = OffloadPlan()
        self._to_save: list[BlockHash] = []
        self._to_save_retention: dict[BlockHash, Retention] = {}
        self.clock = clock
        self.min_priority = min_priority
        self._loaded_this_step: set[BlockHash] = set()
        self._event_lock = threading.Lock()
        # What the stores said, for the next take_plan: the TierEventListener method to call, and its arguments.
        self._events: list[tuple[str, tuple]] = []
        self._listeners: list[TierEventListener] = list(tier_listeners)
        for store in self.stores:
            store.add_listener(self)

    # ---- the manager's connector ------------------------------------------------------------------

    def extend_hit(self, request: Request, block_hashes: Sequence[BlockHash], start: int, end: int) -> int:
        """How many of the blocks ``start`` .. ``end - 1`` (``end``: the last a hit may cover) the tiers hold
        from ``start`` on, read and verified now.

        The blocks stay staged for this request until it is admitted (:meth:`admitted`) or finished.
        """
        staged = self._staged.get(request.request_id)
        if staged is None or staged.start != start or not staged.payloads:
            staged = _Staged(start, *self._run(block_hashes[start:end], KVStore.load_prefix))
            self._staged[request.request_id] = staged
        return len(staged.payloads)

    def held(self, request: Request, block_hashes: Sequence[BlockHash], start: int, end: int) -> dict[str, int]:
        """Tokens per tier (every tier's medium, ``CPU``, ``DISK``, ``REDIS``) that :meth:`extend_hit` would
        take from ``start`` on.

        Only the tiers' indexes are asked (:meth:`KVStore.held_prefix`): no block is read, no tier's LRU
        order or statistics change, nothing is staged.
        """
        by_tier = dict.fromkeys((store.medium for store in self.stores), 0)
        tiers, _ = self._run(block_hashes[start:end], KVStore.held_prefix)
        for tier in tiers:
            by_tier[self.stores[tier].medium] += self.block_size
        return by_tier

    def admitted(
        self, request: Request, block_hashes: Sequence[BlockHash], start: int, targets: Sequence[BlockTargets]
    ) -> None:
        """The request was admitted with the staged blocks ``start`` .. ``start + len(targets) - 1``: load each
        into its blocks ``targets[i]``."""
        staged = self._staged.pop(request.request_id, None)
        num_blocks = len(targets)
        if num_blocks == 0:
            return
        if staged is None or staged.start != start or len(staged.payloads) < num_blocks:
            raise ValueError(f"request {request.request_id!r}: {num_blocks} tier blocks were not looked up")
        by_tier: dict[int, list[tuple[BlockHash, bytes]]] = {}
        for i, target in enumerate(targets):
            tier, payload, block_hash = staged.tiers[i], staged.payloads[i], block_hashes[start + i]
            self._plan.loads.append(BlockLoad(target, block_hash, payload, tier))
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
        self._staged_states.pop(request.request_id, None)

    # ---- the manager's state connector: checkpoints of recurrent layers --------------------------------

    def holds_state(self, block_hash: BlockHash) -> bool:
        """Whether some tier holds the checkpoint at the end of ``block_hash``'s block (its index only)."""
        key = state_key(block_hash)
        return any(store.held_prefix([key]) for store in self.stores)

    def stage_state(self, request: Request, block_hash: BlockHash) -> bool:
        """Read and verify the checkpoint at the end of ``block_hash``'s block from the first tier that holds it,
        staged for ``request`` until it is admitted (:meth:`state_admitted`) or finished."""
        key = state_key(block_hash)
        staged = self._staged_states.get(request.request_id)
        if staged is not None and staged[0] == key:
            return True
        for tier, store in enumerate(self.stores):
            payloads = store.load_prefix([key])
            if payloads:
                self._staged_states[request.request_id] = (key, tier, payloads[0])
                return True
        return False

    def state_admitted(self, request: Request, slot: int) -> None:
        """The request was admitted with its staged checkpoint: load it into its working state slot ``slot``, and
        promote it into the write-through tiers above the one it came from."""
        staged = self._staged_states.pop(request.request_id, None)
        if staged is None:
            raise ValueError(f"request {request.request_id!r}: no tier checkpoint was looked up")
        key, tier, payload = staged
        self._plan.state_loads.append(StateLoad(slot, key, payload, tier))
        self.stores[tier].count_served(1, 0)
        self.writer.submit([t for t in self._write_through_tiers if t < tier], [(key, payload)])

    def checkpoints_saved(self, saved: Sequence[tuple[BlockHash, int, Block | None]]) -> None:
        """This step's forward pass saves these checkpoints (block hash, state slot, the pool's block of that hash):
        the write-through tiers get them after it, with their block's retention."""
        tiers = self._write_through_tiers
        for block_hash, slot, block in saved:
            if tiers and self._offloads(block):
                retention = None if block is None else self._retention_left(block)
                self._plan.state_save_after.append(StateSave(slot, state_key(block_hash), tiers, retention))

    def checkpoint_evicted(self, block_hash: BlockHash, slot: int, block: Block | None) -> None:
        """The device evicts the checkpoint in ``slot``: the write-back tiers get it before the forward pass
        overwrites the slot, with what its block (None: gone) has left of its retention."""
        tiers = self._write_back_tiers
        if tiers and self._offloads(block):
            retention = None if block is None else self._retention_left(block)
            self._plan.state_save_before.append(StateSave(slot, state_key(block_hash), tiers, retention))

    def take_plan(self, cached_block_ids: Callable[[BlockHash], BlockTargets | None]) -> OffloadPlan:
        """This step's transfers for the worker; delivers the tiers' events to the listeners.

        The blocks computed this step are saved from the blocks ``cached_block_ids`` names for their hash
        (skipped when some group lost it already, or when they were just loaded from a tier).
        """
        plan, self._plan = self._plan, OffloadPlan()
        tiers = self._write_through_tiers
        for block_hash in self._to_save:
            if block_hash in self._loaded_this_step:
                continue
            block_ids = cached_block_ids(block_hash)
            if block_ids is not None:
                retention = self._to_save_retention.get(block_hash)
                plan.save_after.append(BlockSave(block_ids, block_hash, tiers, retention))
        self._to_save = []
        self._to_save_retention = {}
        self._loaded_this_step = set()
        self._deliver_events()
        return plan

    def stats(self) -> list[TierStats]:
        return [store.snapshot() for store in self.stores]

    def close(self) -> None:
        self.writer.close()
        for store in self.stores:
            store.close()

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
        if not self._write_through_tiers or stored.group != self._saving_group:
            return
        if stored.retention is None:
            if self._offloads_priority(DEFAULT_PRIORITY):
                self._to_save.extend(stored.block_hashes)
            return
        for block_hash, (priority, ttl_s) in zip(stored.block_hashes, stored.retention, strict=True):
            if not self._offloads_priority(priority):
                continue
            self._to_save.append(block_hash)
            if ttl_s is not None and priority != DEFAULT_PRIORITY:
                self._to_save_retention[block_hash] = (priority, ttl_s)

    def block_reused(self, block: Block, last_copy: bool) -> None:
        tiers = self._write_back_tiers  # one group only (checked at construction)
        if tiers and last_copy and self._offloads(block):
            retention = self._retention_left(block)
            self._plan.save_before.append(BlockSave((block.block_id,), block.block_hash, tiers, retention))

    def _offloads(self, block: Block | None) -> bool:
        """Whether a block (None: gone, at the default priority) goes to the tiers: at ``min_priority`` or above."""
        return self._offloads_priority(DEFAULT_PRIORITY if block is None else block.priority)

    def _offloads_priority(self, priority: int) -> bool:
        """Whether a block of ``priority`` goes to the tiers (an expired one counts at the default priority)."""
        return (DEFAULT_PRIORITY if priority == EXPIRED else priority) >= self.min_priority

    def _retention_left(self, block: Block) -> Retention | None:
        """A demoted block's (priority, seconds left) when a directive marked it: its TTL runs from its last use
        (all of it while in use); None at the default priority or once it ran out."""
        if block.priority in (DEFAULT_PRIORITY, EXPIRED):
            return None
        left = block.ttl_s if block.ref_cnt else block.expires_at - self.clock()
        return (block.priority, left) if left > 0 else None

    # ---- tier events ---------------------------------------------------------------------------

    # The stores name checkpoints by their record keys; listeners hear them apart, by their blocks' hashes (as the
    # device pool's events name a checkpoint), so a router sees where every tier's checkpoints are.

    def tier_blocks_stored(self, medium: str, block_hashes: list[BlockHash], block_size: int) -> None:
        self._buffer_events("stored", medium, block_hashes, (block_size,))

    def tier_blocks_removed(self, medium: str, block_hashes: list[BlockHash]) -> None:
        self._buffer_events("removed", medium, block_hashes, ())

    def _buffer_events(self, change: str, medium: str, keys: list[BlockHash], rest: tuple[int, ...]) -> None:
        """Keep a store's change for the next ``take_plan``: its blocks as ``tier_blocks_<change>``, its
        checkpoints as ``tier_checkpoints_<change>`` under their blocks' hashes."""
        block_hashes = [key for key in keys if not is_state_key(key)]
        checkpoints = [state_block_hash(key) for key in keys if is_state_key(key)]
        with self._event_lock:
            if block_hashes:
                self._events.append((f"tier_blocks_{change}", (medium, block_hashes, *rest)))
            if checkpoints:
                self._events.append((f"tier_checkpoints_{change}", (medium, checkpoints, *rest)))

    def _deliver_events(self) -> None:
        with self._event_lock:
            events, self._events = self._events, []
        for method, args in events:
            for listener in self._listeners:
                getattr(listener, method)(*args)
