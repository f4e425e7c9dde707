"""What a stored block is valid for (:class:`KVLayout`), and the checksummed record every tier stores.

A block's K/V is only correct for the exact model weights, KV dtype, block size and hash chain (algorithm
and seed, summed up by the root hash) that produced it; LoRA adapter and cache salt are already part of
the block hash. The layout's :attr:`~KVLayout.namespace` digests all of it, so two engines share blocks
exactly when they would have computed the same K/V, and a record names its namespace and block hash in
a checksummed header: a file copied from another model, a truncated write or a flipped bit reads as a
miss, never as wrong K/V.

Record: ``MAGIC | version u8 | namespace 16 B | hash length u8 | block hash | [retention] | payload length u64 | check |
payload``, where the check covers everything before it and the payload. Version 1, without a deployment
secret: the check is an xxh3-128 checksum (16 B), which catches accidents but not a forger, since anyone
can compute it. Version 2, with a :class:`RecordKey`: the check is an HMAC-SHA256 under the secret (32 B),
so only holders of the secret write records that read back; the key's public id is part of the
namespace, so engines with different secrets (or none) never share, nor delete each other's, records.

A block kept under a retention directive (:mod:`prefixcache.core.retention`) has the flag ``0x80`` set on its
version byte and ``priority u8 | expires_at f64`` (Unix seconds) right after the block hash, inside what the check
covers: a tier reads its priority back after a restart, refuses the record once it expired, and nobody without the
secret can extend it. A record without retention is byte for byte what it was before the flag existed; an engine
from before it reads a flagged record as a foreign version, a miss.

A model with recurrent layers also stores its **state checkpoints**: the state of every recurrent layer (each conv
window, then each matrix state, in layer order, as ``DecoderForCausalLM.allocate_state_cache`` lays a slot out)
after the block that ends at a block hash, under that hash's :func:`state_key`, in a record with the flag ``0x40``
on its version byte and a payload of :attr:`KVLayout.state_bytes`. A checkpoint lives and goes apart from its
block's record (the device pool also keeps, evicts and hits them apart), so a tier that holds a block need not
hold its checkpoint, nor the other way round. The layout of such a model has ``state_bytes`` in its namespace;
a checkpoint record of another model, or a block record under a checkpoint's key, reads as foreign.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import struct
from dataclasses import dataclass, field, fields

import xxhash

from prefixcache.core.hashing import BlockHash

MAGIC = b"PCKV"
CHECKSUM_VERSION = 1
MAC_VERSION = 2
RETENTION_FLAG = 0x80
STATE_FLAG = 0x40
# What a checkpoint's key adds to its block hash: a key no block hash of the layout's algorithm has (those are
# digests of one fixed length, shorter than a key that ends with this).
STATE_KEY_TAG = b"\x00state"
NAMESPACE_BYTES = 16
MIN_SECRET_BYTES = 16
_HEAD = struct.Struct("<4sB16sB")
_LENGTH = struct.Struct("<Q")
_RETENTION = struct.Struct("<Bd")
_CHECK_BYTES = {CHECKSUM_VERSION: 16, MAC_VERSION: 32}
KV_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class RecordKey:
    """A deployment secret that authenticates the records of shared tiers (disk, Redis) with HMAC-SHA256.

    Every engine that shares a store must be given the same secret; the secret never leaves the process
    (only :attr:`key_id`, an HMAC of a fixed text under it, is written, into the layout description).
    """

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the KV offload secret has {len(self.secret)} bytes, at least {MIN_SECRET_BYTES} are needed "
                "(e.g. the output of `openssl rand -hex 32`)"
            )

    @property
    def key_id(self) -> str:
        return hmac.new(self.secret, b"prefixcache kv offload key id", hashlib.sha256).hexdigest()[:16]

    def mac(self, *parts: bytes | memoryview) -> bytes:
        digest = hmac.new(self.secret, digestmod=hashlib.sha256)
        for part in parts:
            digest.update(part)
        return digest.digest()


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Everything that makes one block's K/V valid, and its shape ``[layers, 2, block_size, kv_heads, head_dim]``;
    with ``record_key``, also who may write its records (see the module docstring).

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
    record_key: RecordKey | None = field(default=None, repr=False)
    state_bytes: int = 0
    namespace: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(KV_DTYPES)}, got {self.dtype!r}")
        if min(self.block_size, self.num_layers, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"block size and KV shape must be positive: {self}")
        if self.state_bytes < 0:
            raise ValueError(f"state_bytes must be >= 0, got {self.state_bytes}")
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

    def payload_bytes(self, key: BlockHash) -> int:
        """Bytes of the payload stored under ``key``: a checkpoint's state (:func:`state_key`) or a block's K/V."""
        return self.state_bytes if is_state_key(key) else self.block_bytes

    @property
    def record_version(self) -> int:
        return CHECKSUM_VERSION if self.record_key is None else MAC_VERSION

    def describe(self) -> dict:
        """The layout as JSON-able values (what the namespace digests; stored next to the blocks for people)."""
        described = {f.name: getattr(self, f.name) for f in fields(self) if f.init and f.name != "record_key"}
        if not self.state_bytes:  # an attention-only model's namespace is what it was before checkpoints existed
            del described["state_bytes"]
        described["root_hash"] = self.root_hash.hex()
        if self.record_key is not None:
            described["record_mac"] = f"hmac-sha256 key {self.record_key.key_id}"
        return described


def state_key(block_hash: BlockHash) -> BlockHash:
    """The key a tier stores the state checkpoint at the end of ``block_hash``'s block under."""
    return BlockHash(block_hash + STATE_KEY_TAG)


def is_state_key(key: BlockHash) -> bool:
    return key.endswith(STATE_KEY_TAG)


def state_block_hash(key: BlockHash) -> BlockHash:
    """The block hash a checkpoint's :func:`state_key` was made from (what KV events name a checkpoint by)."""
    return BlockHash(key[: -len(STATE_KEY_TAG)])


def model_fingerprint(model_config: object, weights_digest: str) -> str:
    """Identifies a model for :class:`KVLayout`: its parsed architecture and the digest of all its weight files
    (``LoadedModel.weights_digest``), so a fine-tune that changes one embedding row gets another namespace."""
    return hashlib.sha256(f"{model_config!r}\n{weights_digest}".encode()).hexdigest()


class RecordError(enum.Enum):
    """Why a stored record was not used: each is a miss, counted in the tier's stats."""

    TRUNCATED = "truncated"
    CORRUPT = "corrupt"
    FOREIGN = "foreign"
    FORGED = "forged"  # not written with the deployment secret


@dataclass(frozen=True, slots=True)
class BadRecord:
    reason: RecordError
    detail: str


@dataclass(frozen=True, slots=True)
class RecordRetention:
    """A stored block's retention: its ``priority`` until ``expires_at`` (Unix seconds), then no record at all."""

    priority: int
    expires_at: float


def encode_record(
    layout: KVLayout, block_hash: BlockHash, payload: bytes, retention: RecordRetention | None = None
) -> bytes:
    """The stored form of one block (or checkpoint, under a :func:`state_key`): header naming namespace, hash (and
    retention), checksum or MAC, payload."""
    check_payload(layout, block_hash, payload)
    version = layout.record_version | (STATE_FLAG if is_state_key(block_hash) else 0)
    kept = b""
    if retention is not None:
        version |= RETENTION_FLAG
        kept = _RETENTION.pack(retention.priority, retention.expires_at)
    header = (
        _HEAD.pack(MAGIC, version, layout.namespace, len(block_hash)) + block_hash + kept + _LENGTH.pack(len(payload))
    )
    return b"".join((header, _check(layout, header, payload), payload))


def check_payload(layout: KVLayout, key: BlockHash, payload: bytes) -> None:
    """ValueError unless ``payload`` has the size of what ``layout`` stores under ``key`` (misuse)."""
    if is_state_key(key) and not layout.state_bytes:
        raise ValueError("this layout has no recurrent state: it stores no checkpoints")
    if len(payload) != layout.payload_bytes(key):
        raise ValueError(f"payload has {len(payload)} bytes, the layout needs {layout.payload_bytes(key)}")


def record_retention(record: bytes | memoryview) -> RecordRetention | None:
    """The retention a record's header names, unverified (for ordering a tier's index; reading the record checks
    it): None without one, or for a record too short or not ours."""
    view = memoryview(record)
    if len(view) < _HEAD.size:
        return None
    magic, version, _, hash_length = _HEAD.unpack_from(view)
    offset = _HEAD.size + hash_length
    if magic != MAGIC or not version & RETENTION_FLAG or len(view) < offset + _RETENTION.size:
        return None
    return RecordRetention(*_RETENTION.unpack_from(view, offset))


def decode_record(layout: KVLayout, block_hash: BlockHash, record: bytes | memoryview) -> bytes | BadRecord:
    """The payload of ``record`` if it is intact (and, with a record key, written with it) and holds
    ``block_hash`` for ``layout``, else why not."""
    view = memoryview(record)
    if len(view) < _HEAD.size:
        return BadRecord(RecordError.TRUNCATED, f"{len(view)} bytes, shorter than a header")
    magic, flagged_version, namespace, hash_length = _HEAD.unpack_from(view)
    version = flagged_version & ~(RETENTION_FLAG | STATE_FLAG)
    if magic != MAGIC or version not in _CHECK_BYTES:
        return BadRecord(RecordError.FOREIGN, "not a prefixcache block record of a known version")
    if bool(flagged_version & STATE_FLAG) != is_state_key(block_hash) or (
        is_state_key(block_hash) and not layout.state_bytes
    ):
        return BadRecord(RecordError.FOREIGN, "a block's K/V where a state checkpoint belongs, or the other way round")
    if namespace != layout.namespace:
        return BadRecord(RecordError.FOREIGN, "written for another model, dtype, block size, hash chain or secret")
    if version != layout.record_version:
        if layout.record_key is not None:
            return BadRecord(RecordError.FORGED, "not authenticated with the deployment secret")
        return BadRecord(RecordError.FOREIGN, "authenticated with a secret this engine was not given")
    hash_end = _HEAD.size + hash_length
    offset = hash_end + (_RETENTION.size if flagged_version & RETENTION_FLAG else 0)
    header_end = offset + _LENGTH.size
    check_end = header_end + _CHECK_BYTES[version]
    if len(view) < check_end:
        return BadRecord(RecordError.TRUNCATED, f"{len(view)} bytes, shorter than a header")
    if view[_HEAD.size : hash_end] != block_hash:
        return BadRecord(RecordError.FOREIGN, "holds another block hash")
    (length,) = _LENGTH.unpack_from(view, offset)
    payload = view[check_end:]
    expected = layout.payload_bytes(block_hash)
    if length != expected:
        return BadRecord(RecordError.CORRUPT, f"payload length {length}, the layout needs {expected}")
    if len(payload) != length:
        return BadRecord(RecordError.TRUNCATED, f"{len(payload)} of {length} payload bytes")
    if not hmac.compare_digest(_check(layout, view[:header_end], payload), view[header_end:check_end]):
        if layout.record_key is not None:
            return BadRecord(RecordError.FORGED, "MAC mismatch: altered, or written without the deployment secret")
        return BadRecord(RecordError.CORRUPT, "checksum mismatch")
    return payload.tobytes()


def _check(layout: KVLayout, header: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    """The check a record of ``layout`` carries: the MAC under its key, else the xxh3-128 checksum."""
    if layout.record_key is not None:
        return layout.record_key.mac(header, payload)
    digest = xxhash.xxh3_128()
    digest.update(header)
    digest.update(payload)
    return digest.digest()
