"""Worker side of the offload connector: blocks between the device KV cache tensors and bytes.

The model runner calls :meth:`OffloadWorker.before_forward` before the forward pass (copy out the blocks the
step is about to overwrite, then load the tier hits into their blocks) and :meth:`OffloadWorker.after_forward`
after it (copy out the blocks it computed). Copies out are synchronous, because the device blocks are
reused; storing them in the tiers is left to the connector's background writer. On a model with recurrent
layers the state checkpoints travel the same way, a state slot of every recurrent layer as one payload
(:func:`read_states`), the tier's checkpoints loaded into the requests' working slots before the forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixcache.core.hashing import BlockHash
from prefixcache.offload.connector import BlockSave, OffloadPlan, StateSave, TierWriter
from prefixcache.offload.record import KVLayout
from prefixcache.offload.store import Retention

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]
# Per recurrent layer its state tensors, slot-major (``DecoderForCausalLM.allocate_state_cache``).
StateCache = Sequence[tuple[torch.Tensor, ...]]


def _layer_rows(
    kv_caches: KVCaches, layer_groups: Sequence[int], targets: Sequence[Sequence[int | None]]
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per layer, (rows of ``targets`` that go to it, their block ids in its group), or None when none do;
    computed once a group. ``targets[r][g]`` is row ``r``'s block in group ``g`` (None: not in that group)."""
    device = kv_caches[0][0].device
    by_group: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}
    for group in set(layer_groups):
        pairs = [(row, target[group]) for row, target in enumerate(targets) if target[group] is not None]
        by_group[group] = (
            (torch.tensor([p[0] for p in pairs], device=device), torch.tensor([p[1] for p in pairs], device=device))
            if pairs
            else None
        )
    return [by_group[group] for group in layer_groups]


def read_blocks(kv_caches: KVCaches, block_ids: Sequence[Sequence[int]], layer_groups: Sequence[int]) -> list[bytes]:
    """Each block's K and V of every layer, ``[layers, 2, block_size, kv_heads, head_dim]``, as bytes.

    ``block_ids[r]`` names row ``r``'s block in each KV cache group; layer ``i`` is read from the block of its
    group ``layer_groups[i]``.
    """
    if not block_ids:
        return []
    rows = _layer_rows(kv_caches, layer_groups, block_ids)
    per_layer = [
        torch.stack((k.index_select(0, index), v.index_select(0, index)), dim=1)
        for (k, v), (_, index) in zip(kv_caches, rows, strict=True)
    ]
    host = torch.stack(per_layer, dim=1).cpu().contiguous()  # [blocks, layers, 2, block_size, heads, dim]
    raw = host.reshape(len(block_ids), -1).view(torch.uint8).numpy()
    return [row.tobytes() for row in raw]


def write_blocks(
    kv_caches: KVCaches,
    targets: Sequence[Sequence[int | None]],
    payloads: Sequence[bytes],
    layer_groups: Sequence[int],
) -> None:
    """Put payloads made by :func:`read_blocks` (or read back from a tier) into their blocks: layer ``i`` of
    payload ``r`` into block ``targets[r][layer_groups[i]]``, unless that is None (the group does not need it)."""
    if not targets:
        return
    key_cache = kv_caches[0][0]
    shape = (len(targets), len(kv_caches), 2, *key_cache.shape[1:])
    data = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(key_cache.dtype).view(shape)
    data = data.to(key_cache.device)
    for layer, ((k, v), rows) in enumerate(zip(kv_caches, _layer_rows(kv_caches, layer_groups, targets), strict=True)):
        if rows is None:
            continue
        source, index = rows
        k.index_copy_(0, index, data[source, layer, 0])
        v.index_copy_(0, index, data[source, layer, 1])


def state_slot_bytes(state_cache: StateCache) -> int:
    """Bytes of one slot's state across every recurrent layer: a checkpoint's payload."""
    return sum(tensor[0].numel() * tensor.element_size() for tensors in state_cache for tensor in tensors)


def read_states(state_cache: StateCache, slots: Sequence[int]) -> list[bytes]:
    """Each slot's state as bytes: every recurrent layer's tensors in order (conv window, then matrix states), each
    C-contiguous in its own dtype."""
    if not slots:
        return []
    index = torch.tensor(list(slots), device=state_cache[0][0].device)
    parts = [
        tensor.index_select(0, index).cpu().contiguous().view(torch.uint8).reshape(len(slots), -1)
        for tensors in state_cache
        for tensor in tensors
    ]
    raw = torch.cat(parts, dim=1).numpy()
    return [row.tobytes() for row in raw]


def write_states(state_cache: StateCache, slots: Sequence[int], payloads: Sequence[bytes]) -> None:
    """Put payloads made by :func:`read_states` (or read back from a tier) into state slots ``slots``."""
    if not slots:
        return
    data = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(len(slots), -1)
    index = torch.tensor(list(slots), device=state_cache[0][0].device)
    offset = 0
    for tensors in state_cache:
        for tensor in tensors:
            size = tensor[0].numel() * tensor.element_size()
            rows = data[:, offset : offset + size].contiguous().view(tensor.dtype).view(len(slots), *tensor.shape[1:])
            tensor.index_copy_(0, index, rows.to(tensor.device))
            offset += size


class OffloadWorker:
    """Moves blocks between the KV cache tensors and the tiers; ``layer_groups[i]`` is the KV cache group of
    layer ``i`` (default: one group). ``state_cache`` (a model with recurrent layers) holds the state slots that
    checkpoints are copied out of and loaded into."""

    def __init__(
        self,
        kv_caches: KVCaches,
        layout: KVLayout,
        writer: TierWriter,
        layer_groups: Sequence[int] | None = None,
        state_cache: StateCache | None = None,
    ) -> None:
        key_cache = kv_caches[0][0]
        actual = (len(kv_caches), 2, *key_cache.shape[1:])
        dtype = str(key_cache.dtype).removeprefix("torch.")
        if actual != layout.shape or dtype != layout.dtype:
            raise ValueError(f"KV cache blocks {actual} {dtype} do not match the layout {layout}")
        self.layer_groups = tuple(layer_groups) if layer_groups is not None else (0,) * len(kv_caches)
        if len(self.layer_groups) != len(kv_caches):
            raise ValueError(f"{len(self.layer_groups)} layer groups for {len(kv_caches)} KV cache layers")
        state_bytes = state_slot_bytes(state_cache) if state_cache else 0
        if state_bytes != layout.state_bytes:
            raise ValueError(f"a state slot takes {state_bytes} bytes, the layout's checkpoints {layout.state_bytes}")
        self.kv_caches = kv_caches
        self.state_cache = state_cache
        self.writer = writer

    def before_forward(self, plan: OffloadPlan | None) -> None:
        if plan is None:
            return
        self._save(plan.save_before)
        self._save_states(plan.state_save_before)
        if plan.loads:
            write_blocks(
                self.kv_caches,
                [load.block_ids for load in plan.loads],
                [load.payload for load in plan.loads],
                self.layer_groups,
            )
        if plan.state_loads:
            loads = plan.state_loads
            write_states(self.state_cache, [load.slot for load in loads], [load.payload for load in loads])

    def after_forward(self, plan: OffloadPlan | None) -> None:
        if plan is not None:
            self._save(plan.save_after)
            self._save_states(plan.state_save_after)

    def _save(self, saves: list[BlockSave]) -> None:
        if not saves:
            return
        payloads = read_blocks(self.kv_caches, [save.block_ids for save in saves], self.layer_groups)
        self._submit([(save.block_hash, save.tiers, save.retention) for save in saves], payloads)

    def _save_states(self, saves: list[StateSave]) -> None:
        if saves:
            payloads = read_states(self.state_cache, [save.slot for save in saves])
            self._submit([(save.key, save.tiers, save.retention) for save in saves], payloads)

    def _submit(self, saves: list[tuple[BlockHash, tuple[int, ...], Retention | None]], payloads: list[bytes]) -> None:
        """Hand the writer each payload for the tiers of its save (key, tiers, retention), one batch per tiers."""
        by_tiers: dict[tuple[int, ...], list[tuple[BlockHash, bytes]]] = {}
        retention: dict[tuple[int, ...], dict[BlockHash, Retention]] = {}
        for (key, tiers, kept), payload in zip(saves, payloads, strict=True):
            by_tiers.setdefault(tiers, []).append((key, payload))
            if kept is not None:
                retention.setdefault(tiers, {})[key] = kept
        for tiers, items in by_tiers.items():
            self.writer.submit(tiers, items, retention.get(tiers))
