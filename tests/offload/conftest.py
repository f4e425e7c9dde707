"""Factories for the offload tests: a tiny block layout, block hashes, distinct payloads, a Redis server."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from prefixcache.bench.live import RedisServer
from prefixcache.core import BlockHash
from prefixcache.offload import KVLayout
from prefixcache.offload.record import RecordKey
from prefixcache.offload.store import KVStore

SECRET = b"0123456789abcdef-deployment-secret"


def make_layout(**overrides) -> KVLayout:
    fields = dict(
        model_fingerprint="tiny-model",
        dtype="float32",
        block_size=4,
        num_layers=2,
        num_kv_heads=2,
        head_dim=4,
        hash_algo="sha256",
        root_hash=b"\x01" * 32,
    )
    fields.update(overrides)
    return KVLayout(**fields)


def keyed_layout(**overrides) -> KVLayout:
    """The tiny layout with records authenticated under SECRET."""
    return make_layout(record_key=RecordKey(SECRET), **overrides)


def forger(layout: KVLayout, secret: bytes | None) -> KVLayout:
    """``layout`` as written by someone who can write to its store and read its namespace (a directory or key
    name shows it) but lacks its secret: records under ``secret`` instead, or only checksummed with None."""
    forged = dataclasses.replace(layout, record_key=None if secret is None else RecordKey(secret))
    object.__setattr__(forged, "namespace", layout.namespace)
    return forged


def block_hash(i: int) -> BlockHash:
    return BlockHash(hashlib.sha256(f"block-{i}".encode()).digest())


def payload(layout: KVLayout, i: int) -> bytes:
    """Distinct bytes for block ``i``: a store mixing blocks up would be caught."""
    seed = hashlib.sha256(f"payload-{i}".encode()).digest()
    return (seed * (layout.block_bytes // len(seed) + 1))[: layout.block_bytes]


def blocks(layout: KVLayout, ids) -> list[tuple[BlockHash, bytes]]:
    return [(block_hash(i), payload(layout, i)) for i in ids]


def check_held_prefix_reads_nothing(store: KVStore, layout: KVLayout) -> None:
    """For an empty store with room for three blocks: ``held_prefix`` names the leading blocks held, and
    neither counts them nor refreshes them in the LRU order."""
    store.store(blocks(layout, [1, 2, 3]))
    before = store.snapshot()
    assert store.held_prefix([block_hash(i) for i in (1, 2, 4, 3)]) == [block_hash(1), block_hash(2)]
    assert store.snapshot() == before
    store.store(blocks(layout, [4]))  # evicts the least recently used: still block 1
    assert [store.held_prefix([block_hash(i)]) != [] for i in (1, 2, 3, 4)] == [False, True, True, True]


@pytest.fixture
def layout() -> KVLayout:
    return make_layout()


@pytest.fixture
def redis_server(tmp_path):
    try:
        server = RedisServer(tmp_path)
    except FileNotFoundError as exc:  # a required test component (.ci/run installs it): fail, never skip
        pytest.fail(f"{exc}; install it with `apt-get install -y redis-server`")
    server.start()
    try:
        yield server
    finally:
        server.stop()
