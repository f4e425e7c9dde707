"""KV cache events as vLLM publishes them, decoded from the wire (written from the format, not our publisher).

Each ZeroMQ PUB message has three frames: topic, sequence number (8-byte big-endian unsigned, from 0)
and payload. The payload is msgpack of a batch, an array ``[ts, events, data_parallel_rank]``; each
event is a map tagged by its class name in the field ``type``. A replay request ``[b"", start_seq]``
on a DEALER socket to the replay ROUTER gets ``[b"", seq, payload]`` for every buffered batch from
``start_seq``, then ``[b"", seq -1, b""]``; vLLM 0.32 puts the topic before the sequence number
(``[b"", topic, seq, payload]``), and both are read. Block hashes are unsigned 64-bit integers by default
(the last 8 bytes of the hash, big-endian); a publisher sending full bytes is read the same way.
An engine with several KV cache groups (hybrid attention) names each event's group (``group_idx``) and, on
``BlockStored``, the group's spec (``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``); a publisher
without them has one group. prefixcache's engines add ``retention`` to a ``BlockStored`` whose blocks a directive
marked: each block's ``[priority, ttl_s]`` (``ttl_s`` null at the default priority).
"""

from __future__ import annotations

import msgspec

MEDIUM_GPU = "GPU"
# vLLM's default block size (its CPU attention backend wants a multiple of 32): what a router assumes for
# backends it knows only by their events, unless told otherwise.
DEFAULT_CONTENT_BLOCK_SIZE = 16
END_OF_REPLAY = -1
_UINT64 = (1 << 64) - 1

WireHash = int | bytes


def external_block_hash(block_hash: WireHash) -> int:
    """vLLM's integer form of a block hash: the hash bytes as a big-endian integer, modulo 2**64."""
    if isinstance(block_hash, int):
        return block_hash & _UINT64
    return int.from_bytes(block_hash, "big") & _UINT64


class BlockStored(msgspec.Struct, tag=True, frozen=True):
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    retention: list[tuple[int, float | None]] | None = None  # prefixcache's: each block's [priority, ttl_s]


class BlockRemoved(msgspec.Struct, tag=True, frozen=True):
    block_hashes: list[WireHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises msgspec.DecodeError (a ValueError) for a payload that is not a batch in this format."""
    return _decoder.decode(payload)


def decode_seq(frame: bytes) -> int:
    """The signed 8-byte big-endian sequence frame (the replay's end marker is -1)."""
    if len(frame) != 8:
        raise ValueError(f"a sequence frame has 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def replay_reply(frames: list[bytes]) -> tuple[bytes, bytes] | None:
    """The sequence and payload frames of one replay reply, with or without a topic frame; None when malformed."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        return None
    return frames[-2], frames[-1]
