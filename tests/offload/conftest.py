"""Factories for the offload tests: a tiny block layout, block hashes, distinct payloads, a Redis server."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

import pytest

from prefixcache.bench.live import RedisServer, free_port
from prefixcache.core import BlockHash
from prefixcache.offload import KVLayout
from prefixcache.offload.record import RecordKey, RecordRetention, encode_record
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


class WallClock:
    """A wall clock the test moves: starts at the real time (Redis expires keys on its own clock)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


RETAINED, LOW = (90, 100.0), (10, 100.0)  # (priority, seconds left), as the connector hands them over


def retained_record_bytes(layout: KVLayout) -> int:
    """The size of a record with a retention field (the largest a block's record gets)."""
    return len(encode_record(layout, block_hash(0), payload(layout, 0), RecordRetention(90, 0.0)))


def check_retention_order(store: KVStore, layout: KVLayout, clock: WallClock) -> None:
    """For an empty store with room for three blocks and any mix of records: it evicts in the device pool's order
    (expired, then lowest priority, least recently used within one), and never loads an expired block."""
    store.store(blocks(layout, [1]), {block_hash(1): RETAINED})  # the oldest, but retained
    store.store(blocks(layout, [2]))
    store.store(blocks(layout, [3]), {block_hash(3): LOW})
    store.store(blocks(layout, [4]))  # the low one goes first, though the youngest
    assert [store.held_prefix([block_hash(i)]) != [] for i in (1, 2, 3, 4)] == [True, True, False, True]
    store.store(blocks(layout, [5]))  # then the default ones, least recently used first
    store.store(blocks(layout, [6]))
    assert [store.held_prefix([block_hash(i)]) != [] for i in range(1, 7)] == [True, False, False, False, True, True]
    assert store.load_prefix([block_hash(1)]) == [payload(layout, 1)]
    assert store.load_prefix([block_hash(5), block_hash(6)]) == [payload(layout, 5), payload(layout, 6)]
    store.store(blocks(layout, [7]))  # block 1 is the least recently used now, but a hit keeps its priority
    assert [store.held_prefix([block_hash(i)]) != [] for i in (1, 5, 6, 7)] == [True, False, True, True]
    clock.now += 100.5  # block 1's time ran out: never loaded again, and the first to go
    assert store.load_prefix([block_hash(1), block_hash(6)]) == []
    store.store(blocks(layout, [8]))
    assert [store.held_prefix([block_hash(i)]) != [] for i in (1, 6, 7, 8)] == [False, True, True, True]
    assert store.load_prefix([block_hash(6), block_hash(7), block_hash(8)]) == [payload(layout, i) for i in (6, 7, 8)]


@pytest.fixture
def layout() -> KVLayout:
    return make_layout()


def start_redis(directory: Path, **options):
    try:
        server = RedisServer(directory, **options)
    except FileNotFoundError as exc:  # a required test component (.ci/run installs it): fail, never skip
        pytest.fail(f"{exc}; install it with `apt-get install -y redis-server`")
    server.start()
    return server


@pytest.fixture
def redis_server(tmp_path):
    server = start_redis(tmp_path)
    try:
        yield server
    finally:
        server.stop()


# The ACL the README's Security section gives the tier's own Redis user: its keys and the commands it runs.
REDIS_ACL_COMMANDS = [
    *("ping", "get", "set", "exists", "del", "type", "strlen", "incr", "incrby", "decrby"),
    *("zadd", "zrem", "zrange", "zrangebyscore", "zscore", "zcard", "hget", "hset", "hdel", "hexists"),
    *("pexpireat", "eval", "evalsha", "script|load"),
]


@dataclasses.dataclass
class SecuredRedis:
    """A redis-server with ``requirepass``, an ACL user limited to the tier's keys and commands, and a TLS port
    that requires client certificates, all made by a throwaway CA."""

    server: RedisServer
    password: str
    user: str
    user_password: str
    tls_port: int
    ca: Path
    client_cert: Path
    client_key: Path

    def url(self, credentials: str = "", tls: bool = False, query: str = "") -> str:
        scheme, port = ("rediss", self.tls_port) if tls else ("redis", self.server.port)
        return f"{scheme}://{credentials}{'@' if credentials else ''}127.0.0.1:{port}/0{'?' if query else ''}{query}"

    @property
    def tls_files(self) -> str:
        return f"ssl_ca_certs={self.ca}&ssl_certfile={self.client_cert}&ssl_keyfile={self.client_key}"


@pytest.fixture
def secured_redis(tmp_path):
    import trustme

    ca = trustme.CA()
    server_cert, client_cert = ca.issue_cert("127.0.0.1", "localhost"), ca.issue_cert("prefixcache-engine")
    files = {name: tmp_path / f"{name}.pem" for name in ("ca", "server", "server-key", "client", "client-key")}
    ca.cert_pem.write_to_path(files["ca"])
    server_cert.cert_chain_pems[0].write_to_path(files["server"])
    server_cert.private_key_pem.write_to_path(files["server-key"])
    client_cert.cert_chain_pems[0].write_to_path(files["client"])
    client_cert.private_key_pem.write_to_path(files["client-key"])
    tls_port = free_port()
    user, user_password = "prefixcache", "user-password-4d1f"
    acl = ["--user", user, "on", f">{user_password}", "resetchannels", "~prefixcache:*", "-@all"]
    acl += [f"+{command}" for command in REDIS_ACL_COMMANDS]
    tls = ["--tls-port", str(tls_port), "--tls-cert-file", str(files["server"])]
    tls += ["--tls-key-file", str(files["server-key"]), "--tls-ca-cert-file", str(files["ca"])]
    tls += ["--tls-auth-clients", "yes"]
    server = start_redis(tmp_path, extra_args=acl + tls, password="default-password-9c2e")
    try:
        yield SecuredRedis(
            server,
            "default-password-9c2e",
            user,
            user_password,
            tls_port,
            files["ca"],
            files["client"],
            files["client-key"],
        )
    finally:
        server.stop()
