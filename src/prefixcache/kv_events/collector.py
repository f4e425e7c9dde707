"""Turns the block pool's changes into KV cache events and holds them until the engine publishes them.

``blocks_stored`` is called when blocks are allocated, before the forward pass writes their K/V, so
events wait here: the engine takes them after the pass (:meth:`KVEventCollector.take`) and a router
never routes to K/V that does not exist yet.

Extra keys map onto vLLM's ``extra_keys`` shape, one tuple (or None) per block, in vLLM's order:
the LoRA name, then one ``(mm identifier, offset of the item from the block start)`` pair per
multimodal item the block overlaps. Our hashes keep the tags (``("lora", name)``, ``("mm", id, offset)``,
``("salt", s)``). Unlike vLLM, the cache salt is never published: it names a tenant (with API keys, the
tenant salt of its key) or is a client's secret, and the block hashes, which it went into, are all a
router needs. Token ids are published (as vLLM does) unless the config's ``publish_token_ids`` is off.

KV cache groups are told apart as vLLM tells them: every event names its group (``group_idx``), and a
``BlockStored`` also the group's attention (``kv_cache_spec_kind``: ``full_attention`` or
``sliding_window``, with ``kv_cache_spec_sliding_window``; ``mamba`` for the recurrent-state group, whose
"blocks" are the state checkpoints, each under the hash of the block at whose end it was taken). A hash stored in
every group is one event a group. A tier record holds a block for every attention group, so a tier's block events
come once an attention group; a tier's checkpoints (records of their own) come as the state group's, with the
tier's medium: the same shape as the device's checkpoints, so vLLM's decoder reads them. A consumer that keeps
what each group holds on each medium predicts the engine's hit with
:func:`prefixcache.core.kv_cache_groups.longest_common_hit` on the device, continued into the tiers by
:func:`~prefixcache.core.kv_cache_groups.checkpoint_boundary` (see :mod:`prefixcache.router.index`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefixcache.core.block_pool import BlockPoolListener, StoredBlocks
from prefixcache.core.hashing import LORA_TAG, MM_TAG, SALT_TAG, BlockHash, ExtraKeys
from prefixcache.core.kv_cache_groups import FULL_ATTENTION, KVCacheGroupSpec, check_groups
from prefixcache.kv_events.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    encode_block_hash,
)
from prefixcache.offload.store import TierEventListener

_VLLM_ORDER = {LORA_TAG: 0, MM_TAG: 1}


def vllm_extra_keys(keys: ExtraKeys | None) -> tuple[Any, ...] | None:
    """One block's tagged extra keys in vLLM's untagged order (LoRA, multimodal), the salt left out; None when
    none are left."""
    published = sorted((key for key in keys or () if key[0] != SALT_TAG), key=lambda key: _VLLM_ORDER[key[0]])
    if not published:
        return None
    return tuple(tuple(key[1:]) if key[0] == MM_TAG else key[1] for key in published)


class KVEventCollector(BlockPoolListener, TierEventListener):
    """Buffers the cache's events in the order they happen.

    ``medium`` names the device pool it listens to: ``"GPU"`` for the engine's own KV cache whatever the
    device (vLLM's convention). As a ``TierEventListener`` it also hears the offload tiers, whose events carry
    their own medium (``"CPU"``, ``"DISK"``, ``"REDIS"``) and, like vLLM's offloading connector's when it has
    no token metadata, no tokens or parent: a router needs only which hashes each engine can load.
    ``groups`` are the KV cache groups of the pool (default: one full-attention group). With ``token_ids``
    false the engine's own ``BlockStored`` events leave the tokens out too.
    """

    def __init__(
        self,
        medium: str = MEDIUM_GPU,
        block_hash_encoding: str = "uint64",
        groups: Sequence[KVCacheGroupSpec] = (FULL_ATTENTION,),
        token_ids: bool = True,
    ) -> None:
        self.medium = medium
        self.block_hash_encoding = block_hash_encoding
        self.groups = check_groups(groups)
        self.token_ids = token_ids
        # A tier's blocks serve the attention groups, its checkpoints the recurrent-state group.
        self._attention_groups = [g for g, spec in enumerate(self.groups) if not spec.recurrent_state]
        self._state_groups = [g for g, spec in enumerate(self.groups) if spec.recurrent_state]
        self._events: list[KVCacheEvent] = []

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def blocks_stored(self, stored: StoredBlocks) -> None:
        encoding = self.block_hash_encoding
        parent = stored.parent_block_hash
        self._events.append(
            BlockStored(
                block_hashes=[encode_block_hash(h, encoding) for h in stored.block_hashes],
                parent_block_hash=None if parent is None else encode_block_hash(parent, encoding),
                token_ids=stored.token_ids if self.token_ids else [],
                block_size=stored.block_size,
                lora_id=None,
                medium=self.medium,
                lora_name=stored.lora_name,
                extra_keys=[vllm_extra_keys(keys) for keys in stored.extra_keys],
                group_idx=stored.group,
                kv_cache_spec_kind=self.groups[stored.group].kind,
                kv_cache_spec_sliding_window=self.groups[stored.group].sliding_window,
                retention=stored.retention,
            )
        )

    def blocks_removed(self, block_hashes: list[BlockHash], group: int) -> None:
        hashes = [encode_block_hash(h, self.block_hash_encoding) for h in block_hashes]
        self._events.append(BlockRemoved(block_hashes=hashes, medium=self.medium, group_idx=group))

    def cache_cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def tier_blocks_stored(self, medium: str, block_hashes: list[BlockHash], block_size: int) -> None:
        self._tier_stored(medium, block_hashes, block_size, self._attention_groups)

    def tier_blocks_removed(self, medium: str, block_hashes: list[BlockHash]) -> None:
        self._tier_removed(medium, block_hashes, self._attention_groups)

    def tier_checkpoints_stored(self, medium: str, block_hashes: list[BlockHash], block_size: int) -> None:
        self._tier_stored(medium, block_hashes, block_size, self._state_groups)

    def tier_checkpoints_removed(self, medium: str, block_hashes: list[BlockHash]) -> None:
        self._tier_removed(medium, block_hashes, self._state_groups)

    def _tier_stored(self, medium: str, block_hashes: list[BlockHash], block_size: int, groups: list[int]) -> None:
        hashes = [encode_block_hash(h, self.block_hash_encoding) for h in block_hashes]
        for group in groups:
            spec = self.groups[group]
            self._events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=block_size,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    group_idx=group,
                    kv_cache_spec_kind=spec.kind,
                    kv_cache_spec_sliding_window=spec.sliding_window,
                )
            )

    def _tier_removed(self, medium: str, block_hashes: list[BlockHash], groups: list[int]) -> None:
        hashes = [encode_block_hash(h, self.block_hash_encoding) for h in block_hashes]
        for group in groups:
            self._events.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group))
