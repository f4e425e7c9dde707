"""Worker side of the offload connector: blocks between the device KV cache tensors and bytes.

The model runner calls :meth:`OffloadWorker.before_forward` before the forward pass (copy out the blocks the
step is about to overwrite, then load the tier hits into their blocks) and :meth:`OffloadWorker.after_forward`
after it (copy out the blocks it computed). Copies out are synchronous, because the device blocks are
reused; storing them in the tiers is left to the connector's background writer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixcache.offload.connector import BlockSave, OffloadPlan, TierWriter
from prefixcache.offload.record import KVLayout

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def read_blocks(kv_caches: KVCaches, block_ids: Sequence[int]) -> list[bytes]:
    """Each block's K and V of every layer, ``[layers, 2, block_size, kv_heads, head_dim]``, as bytes."""
    if not block_ids:
        return []
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0][0].device)
    per_layer = [torch.stack((k.index_select(0, index), v.index_select(0, index)), dim=1) for k, v in kv_caches]
    host = torch.stack(per_layer, dim=1).cpu().contiguous()  # [blocks, layers, 2, block_size, heads, dim]
    raw = host.reshape(len(block_ids), -1).view(torch.uint8).numpy()
    return [row.tobytes() for row in raw]


def write_blocks(kv_caches: KVCaches, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
    """Put payloads made by :func:`read_blocks` (or read back from a tier) into the blocks ``block_ids``."""
    if not block_ids:
        return
    key_cache = kv_caches[0][0]
    shape = (len(block_ids), len(kv_caches), 2, *key_cache.shape[1:])
    data = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(key_cache.dtype).view(shape)
    data = data.to(key_cache.device)
    index = torch.tensor(block_ids, dtype=torch.long, device=key_cache.device)
    for layer, (k, v) in enumerate(kv_caches):
        k.index_copy_(0, index, data[:, layer, 0])
        v.index_copy_(0, index, data[:, layer, 1])


class OffloadWorker:
    def __init__(self, kv_caches: KVCaches, layout: KVLayout, writer: TierWriter) -> None:
        key_cache = kv_caches[0][0]
        actual = (len(kv_caches), 2, *key_cache.shape[1:])
        dtype = str(key_cache.dtype).removeprefix("torch.")
        if actual != layout.shape or dtype != layout.dtype:
            raise ValueError(f"KV cache blocks {actual} {dtype} do not match the layout {layout}")
        self.kv_caches = kv_caches
        self.writer = writer

    def before_forward(self, plan: OffloadPlan | None) -> None:
        if plan is None:
            return
        self._save(plan.save_before)
        if plan.loads:
            write_blocks(self.kv_caches, [load.block_id for load in plan.loads], [load.payload for load in plan.loads])

    def after_forward(self, plan: OffloadPlan | None) -> None:
        if plan is not None:
            self._save(plan.save_after)

    def _save(self, saves: list[BlockSave]) -> None:
        if not saves:
            return
        payloads = read_blocks(self.kv_caches, [save.block_id for save in saves])
        by_tiers: dict[tuple[int, ...], list[tuple[bytes, bytes]]] = {}
        for save, payload in zip(saves, payloads, strict=True):
            by_tiers.setdefault(save.tiers, []).append((save.block_hash, payload))
        for tiers, items in by_tiers.items():
            self.writer.submit(tiers, items)
