"""KV cache events in vLLM's wire format (vllm/distributed/kv_events.py, map-encoded events).

A message's payload is the msgpack of a :class:`KVEventBatch`, an array ``[ts, events, data_parallel_rank]``.
Each event is a map tagged by its class name under ``"type"``, e.g.
``{"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", "group_idx": 0}``. Fields that
have defaults are left out while they hold them (msgspec ``omit_defaults``), as vLLM does.
"""

from __future__ import annotations

from typing import Any

import msgspec

from prefixcache.core.hashing import BlockHash

ExternalBlockHash = int | bytes

MEDIUM_GPU = "GPU"
_UINT64_MASK = (1 << 64) - 1


def encode_block_hash(block_hash: BlockHash, encoding: str) -> ExternalBlockHash:
    """A block hash as consumers see it: vLLM's uint64 (low 64 bits of the digest, big-endian) or the bytes."""
    if encoding == "bytes":
        return bytes(block_hash)
    return int.from_bytes(block_hash, "big") & _UINT64_MASK


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged union: the tag is the class name."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks whose K/V was written; ``extra_keys`` has one entry a block."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # prefixcache's own, last and omitted unless a retention directive marked a block: each block's
    # [priority, ttl_s] (ttl_s null at the default priority 35). Decoders that do not know it skip it.
    retention: list[tuple[int, float | None]] | None = None


class BlockRemoved(KVCacheEvent):
    """The medium no longer holds any block with these hashes."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every cached block was dropped (prefix cache reset)."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
