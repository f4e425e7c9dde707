"""What a stored block is valid for (:class:`KVLayout`), and the checksummed record every tier stores.

A block's K/V is only correct for the exact model weights, KV dtype, block size and hash chain (algorithm
and seed, summed up by the root hash) that produced it; LoRA adapter and cache salt are already part of
the block hash. The layout's :attr:`~KVLayout.namespace` digests all of it, so two engines share blocks
exactly when they would have computed the same K/V, and a record names its namespace and block hash in
a checksummed header: a file copied from another model, a truncated write or a flipped bit reads as a
miss, never as wrong K/V.

Record: ``MAGIC | version u8 | namespace 16 B | hash length u8 | block hash | payload length u64 |
xxh3-128 of everything before it and of the payload 16 B | payload``.
"""

from __future__ import annotations

import enum
import hashlib
import json
import struct
from dataclasses import dataclass, field, fields

import xxhash

from prefixcache.core.hashing import BlockHash

MAGIC = b"PCKV"
VERSION = 1
NAMESPACE_BYTES = 16
_HEAD = struct.Struct("<4sB16sB")
_LENGTH = struct.Struct("<Q")
_CHECKSUM_BYTES = 16
KV_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Everything that makes one block's K/V valid, and its shape ``[layers, 2, block_size, kv_heads, head_dim]``.

    ``model_fingerprint`` identifies the model (:func:`model_fingerprint`: its config and a digest of every
    byte of its weights); ``root_hash`` is the parent of every chain's first block, so it stands for the
    hash algorithm and seed.
    """

    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hash_algo: str
    root_hash: bytes
    namespace: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(KV_DTYPES)}, got {self.dtype!r}")
        if min(self.block_size, self.num_layers, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"block size and KV shape must be positive: {self}")
        if not self.model_fingerprint:
            raise ValueError("model_fingerprint must not be empty")
        described = json.dumps(self.describe(), sort_keys=True).encode()
        object.__setattr__(self, "namespace", hashlib.sha256(described).digest()[:NAMESPACE_BYTES])

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's payload: K and V of every layer."""
        layers, kv, tokens, heads, dim = self.shape
        return layers * kv * tokens * heads * dim * KV_DTYPES[self.dtype]

    def describe(self) -> dict:
        """The layout as JSON-able values (what the namespace digests; stored next to the blocks for people)."""
        described = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        described["root_hash"] = self.root_hash.hex()
        return described


def model_fingerprint(model_config: object, weights_digest: str) -> str:
    """Identifies a model for :class:`KVLayout`: its parsed architecture and the digest of all its weight files
    (``LoadedModel.weights_digest``), so a fine-tune that changes one embedding row gets another namespace."""
    return hashlib.sha256(f"{model_config!r}\n{weights_digest}".encode()).hexdigest()


class RecordError(enum.Enum):
    """Why a stored record was not used: each is a miss, counted in the tier's stats."""

    TRUNCATED = "truncated"
    CORRUPT = "corrupt"
    FOREIGN = "foreign"


@dataclass(frozen=True, slots=True)
class BadRecord:
    reason: RecordError
    detail: str


def encode_record(layout: KVLayout, block_hash: BlockHash, payload: bytes) -> bytes:
    """The stored form of one block: header naming namespace and hash, checksum, payload."""
    if len(payload) != layout.block_bytes:
        raise ValueError(f"payload has {len(payload)} bytes, the layout needs {layout.block_bytes}")
    header = _HEAD.pack(MAGIC, VERSION, layout.namespace, len(block_hash)) + block_hash + _LENGTH.pack(len(payload))
    digest = xxhash.xxh3_128()
    digest.update(header)
    digest.update(payload)
    return b"".join((header, digest.digest(), payload))


def decode_record(layout: KVLayout, block_hash: BlockHash, record: bytes | memoryview) -> bytes | BadRecord:
    """The payload of ``record`` if it is intact and holds ``block_hash`` for ``layout``, else why not."""
    view = memoryview(record)
    if len(view) < _HEAD.size:
        return BadRecord(RecordError.TRUNCATED, f"{len(view)} bytes, shorter than a header")
    magic, version, namespace, hash_length = _HEAD.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        return BadRecord(RecordError.FOREIGN, f"not a version {VERSION} prefixcache block record")
    if namespace != layout.namespace:
        return BadRecord(RecordError.FOREIGN, "written for another model, dtype, block size or hash chain")
    offset = _HEAD.size + hash_length
    header_end = offset + _LENGTH.size
    if len(view) < header_end + _CHECKSUM_BYTES:
        return BadRecord(RecordError.TRUNCATED, f"{len(view)} bytes, shorter than a header")
    if view[_HEAD.size : offset] != block_hash:
        return BadRecord(RecordError.FOREIGN, "holds another block hash")
    (length,) = _LENGTH.unpack_from(view, offset)
    payload = view[header_end + _CHECKSUM_BYTES :]
    if length != layout.block_bytes:
        return BadRecord(RecordError.CORRUPT, f"payload length {length}, the layout needs {layout.block_bytes}")
    if len(payload) != length:
        return BadRecord(RecordError.TRUNCATED, f"{len(payload)} of {length} payload bytes")
    digest = xxhash.xxh3_128()
    digest.update(view[:header_end])
    digest.update(payload)
    if digest.digest() != view[header_end : header_end + _CHECKSUM_BYTES]:
        return BadRecord(RecordError.CORRUPT, "checksum mismatch")
    return payload.tobytes()
