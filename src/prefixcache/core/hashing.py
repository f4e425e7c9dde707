"""Chained block hashing: one hash stands for the whole prefix up to the end of its block.

``h_k = H(h_{k-1}, tokens_k, extra_keys_k)``. The first block's parent is a root hash derived from a
seed string that is the same on every process and machine, so engines and a router on different
hosts agree on the hashes of the same prompt.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any, NewType

import cbor2
import xxhash

logger = logging.getLogger(__name__)

BlockHash = NewType("BlockHash", bytes)

DEFAULT_HASH_SEED = "prefixcache"
HASH_SEED_ENV = "PREFIXCACHE_HASH_SEED"
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
UNSAFE_ACROSS_TENANTS = frozenset({"xxhash", "xxhash_cbor"})

# Tags keep extra keys of different kinds apart: a LoRA named "x" never hashes like a salt "x".
LORA_TAG = "lora"
MM_TAG = "mm"
SALT_TAG = "salt"

ExtraKeys = tuple[tuple[Any, ...], ...]

_TOKEN_TYPECODE = "I"  # uint32: every vocabulary in use fits, 4 bytes a token
_BIG_ENDIAN = sys.byteorder == "big"


def pack_token_ids(token_ids: Sequence[int]) -> array:
    """Token ids as packed little-endian uint32; raises ValueError for ids that are not in [0, 2**32)."""
    try:
        packed = array(_TOKEN_TYPECODE, token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    return packed


def _token_bytes(packed: array, start: int, end: int) -> bytes:
    chunk = packed[start:end]
    if _BIG_ENDIAN:
        chunk.byteswap()
    return chunk.tobytes()


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_DIGESTS: dict[str, Callable[[bytes], bytes]] = {
    "sha256": _sha256,
    "sha256_cbor": _sha256,
    "xxhash": xxhash.xxh3_128_digest,
    "xxhash_cbor": xxhash.xxh3_128_digest,
}


def _check_algo(algo: str) -> None:
    if algo not in _DIGESTS:
        raise ValueError(f"unknown hash algorithm {algo!r}; choose one of {', '.join(HASH_ALGOS)}")


def resolve_hash_seed(seed: str | None = None) -> str:
    """The seed in force: the argument, else ``$PREFIXCACHE_HASH_SEED``, else the default."""
    return os.environ.get(HASH_SEED_ENV, DEFAULT_HASH_SEED) if seed is None else seed


def root_hash(algo: str, seed: str | None = None) -> BlockHash:
    """The parent of every chain's first block: ``H(seed)``, seed from the argument, env or default."""
    _check_algo(algo)
    return BlockHash(_DIGESTS[algo](resolve_hash_seed(seed).encode()))


def hash_blocks(
    algo: str,
    parent: BlockHash,
    packed: array,
    start_block: int,
    num_blocks: int,
    block_size: int,
    extra_keys: Callable[[int], ExtraKeys | None] | None = None,
) -> list[BlockHash]:
    """Hash ``num_blocks`` consecutive full blocks of ``packed`` starting at ``start_block``.

    ``parent`` is the hash of the block before ``start_block`` (the root hash for block 0);
    ``extra_keys(block_index)`` gives each block's tagged extra keys. Binary algorithms hash
    ``parent || uint32 token count || uint32 tokens || CBOR(extra keys)``; the ``_cbor`` ones hash
    the canonical CBOR of ``[parent, [tokens], extra keys or null]``, reproducible from any language.
    """
    _check_algo(algo)
    digest = _DIGESTS[algo]
    out: list[BlockHash] = []
    if algo.endswith("_cbor"):
        dumps = cbor2.dumps
        for k in range(start_block, start_block + num_blocks):
            extra = extra_keys(k) if extra_keys else None
            tokens = packed[k * block_size : (k + 1) * block_size].tolist()
            parent = BlockHash(digest(dumps([parent, tokens, extra], canonical=True)))
            out.append(parent)
        return out
    header = struct.pack("<I", block_size)
    data = _token_bytes(packed, start_block * block_size, (start_block + num_blocks) * block_size)
    width = 4 * block_size
    for i in range(num_blocks):
        payload = parent + header + data[i * width : (i + 1) * width]
        if extra_keys is not None:
            extra = extra_keys(start_block + i)
            if extra:
                payload += cbor2.dumps(extra, canonical=True)
        parent = BlockHash(digest(payload))
        out.append(parent)
    return out


def hash_block_tokens(
    algo: str, parent: BlockHash, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None
) -> BlockHash:
    """The hash of one block of tokens (any length) under ``parent``: the pure form of :func:`hash_blocks`."""
    packed = pack_token_ids(token_ids)
    return hash_blocks(algo, parent, packed, 0, 1, len(token_ids), lambda _: extra_keys)[0]


def warn_if_unsafe(algo: str) -> None:
    """xxhash is fast but not collision-resistant: a crafted prompt could alias another tenant's KV.

    Said once per process (a benchmark builds many managers; the first unsafe one is enough to name the risk)."""
    global _warned_unsafe
    _check_algo(algo)
    if algo in UNSAFE_ACROSS_TENANTS and not _warned_unsafe:
        _warned_unsafe = True
        logger.warning(
            "prefix-cache hash %r is not cryptographic (nor is any of %s): a tenant could craft a collision and "
            "read another tenant's cached KV; use sha256 when tenants do not trust each other",
            algo,
            ", ".join(sorted(UNSAFE_ACROSS_TENANTS)),
        )


_warned_unsafe = False
