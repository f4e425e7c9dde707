"""A consumer's decoder, written from vLLM's documented wire format (not from our classes).

vLLM >= #42892: the batch is a positional array ``[ts, events, data_parallel_rank]``; each event is a
msgpack map tagged by its class name under ``"type"``. Fields we do not declare (``group_idx`` ...)
are ignored, as a consumer built on an older struct set would.
"""

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


decoder = msgspec.msgpack.Decoder(KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def as_uint64(block_hash: bytes) -> int:
    """vLLM's default external block hash: the digest's low 64 bits, read big-endian."""
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF
