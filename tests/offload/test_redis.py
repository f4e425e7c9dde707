"""Redis tier against a real redis-server: shared between stores, LRU within its capacity, checked records,
and serving on through Redis going down at start or mid-run until it comes back."""

import logging

import pytest
import redis

from prefixcache.offload import HostMemoryStore
from prefixcache.offload.record import encode_record
from prefixcache.offload.redis_store import RedisStore
from tests.offload.conftest import (
    RETAINED,
    WallClock,
    block_hash,
    blocks,
    check_held_prefix_reads_nothing,
    check_retention_order,
    forger,
    keyed_layout,
    make_layout,
    payload,
    retained_record_bytes,
)
from tests.offload.test_host import Recorder


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def hashes(*ids):
    return [block_hash(i) for i in ids]


@pytest.fixture
def make_store(redis_server):
    made = []

    def make(layout, capacity_bytes=2**20, **kwargs):
        store = RedisStore(layout, redis_server.url, capacity_bytes, **kwargs)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def record_bytes(layout):
    return len(encode_record(layout, block_hash(0), payload(layout, 0)))


def test_round_trip_is_exact_and_stops_at_the_first_missing_block(layout, make_store):
    store = make_store(layout)
    store.store(blocks(layout, [0, 1, 3]))
    assert store.load_prefix(hashes(0, 1, 2, 3)) == [payload(layout, 0), payload(layout, 1)]
    stats = store.snapshot()
    assert (stats.blocks_stored, stats.hits, stats.num_blocks, stats.available) == (3, 2, 3, True)
    assert stats.used_bytes == 3 * record_bytes(layout)


def test_one_store_hits_what_another_stored(layout, make_store):
    writer, reader = make_store(layout), make_store(layout)
    recorder = Recorder()
    writer.add_listener(recorder)
    writer.store(blocks(layout, [1, 2]))
    reader.store(blocks(layout, [2, 3]))  # 2 is there already: only 3 is written
    assert reader.load_prefix(hashes(1, 2, 3)) == [payload(layout, i) for i in (1, 2, 3)]
    assert writer.load_prefix(hashes(3)) == [payload(layout, 3)]
    assert reader.snapshot().blocks_stored == 1
    assert recorder.events == [("stored", "REDIS", hashes(1, 2), layout.block_size)]


def test_other_layouts_never_see_the_blocks(layout, make_store):
    make_store(layout).store(blocks(layout, [1]))
    for change in ({"model_fingerprint": "other"}, {"dtype": "bfloat16"}, {"block_size": 8}):
        assert make_store(make_layout(**change)).load_prefix(hashes(1)) == []


def test_capacity_evicts_least_recently_used_across_stores(layout, make_store):
    capacity = 3 * record_bytes(layout)
    first, second = make_store(layout, capacity), make_store(layout, capacity)
    recorder = Recorder()
    second.add_listener(recorder)
    first.store(blocks(layout, [1, 2, 3]))
    assert second.load_prefix(hashes(1)) == [payload(layout, 1)]
    second.store(blocks(layout, [4]))
    assert [first.load_prefix([h]) != [] for h in hashes(1, 2, 3, 4)] == [True, False, True, True]
    assert recorder.events[-1] == ("removed", "REDIS", hashes(2))
    assert second.snapshot().used_bytes == capacity


def test_held_prefix_reads_nothing_and_leaves_the_lru_order(layout, make_store):
    check_held_prefix_reads_nothing(make_store(layout, 3 * record_bytes(layout)), layout)


def test_a_corrupt_value_is_a_miss_and_is_deleted(layout, make_store, redis_server, caplog):
    store = make_store(layout)
    store.store(blocks(layout, [1, 2]))
    raw = redis.Redis.from_url(redis_server.url)
    try:
        value = bytearray(raw.get(store.key_of(block_hash(2))))
        value[-1] ^= 0xFF
        raw.set(store.key_of(block_hash(2)), bytes(value))
        with caplog.at_level(logging.WARNING):
            assert store.load_prefix(hashes(1, 2)) == [payload(layout, 1)]
        assert raw.exists(store.key_of(block_hash(2))) == 0
    finally:
        raw.close()
    assert store.snapshot().bad_records == 1
    assert "corrupt" in caplog.text


@pytest.mark.parametrize(
    "spoil",
    [
        lambda raw, key: raw.set(key, b""),
        lambda raw, key: (raw.delete(key), raw.rpush(key, b"not", b"a record")),
        lambda raw, key: (raw.delete(key), raw.hset(key, "field", "value")),
    ],
    ids=["empty-value", "list", "hash"],
)
def test_a_key_that_holds_no_record_is_a_miss_deleted_and_stored_again(layout, make_store, redis_server, spoil):
    store = make_store(layout)
    store.store(blocks(layout, [1, 2, 3]))
    raw = redis.Redis.from_url(redis_server.url)
    try:
        spoil(raw, store.key_of(block_hash(2)))
        assert store.load_prefix(hashes(1, 2, 3)) == [payload(layout, 1)]  # the lookup itself never fails
        assert raw.exists(store.key_of(block_hash(2))) == 0
        assert store.snapshot().bad_records == 1 and store.snapshot().errors == 0
        store.store(blocks(layout, [2]))
        assert store.load_prefix(hashes(1, 2, 3)) == [payload(layout, i) for i in (1, 2, 3)]

        # spoiled before anyone reads it: a write replaces it
        spoil(raw, store.key_of(block_hash(4)))
        store.store(blocks(layout, [4]))
        assert store.load_prefix(hashes(4)) == [payload(layout, 4)]
        assert store.snapshot().bad_records == 2
        assert store.snapshot().used_bytes == int(raw.get(f"prefixcache:{layout.namespace.hex()}:bytes"))
        assert store.snapshot().used_bytes == 4 * record_bytes(layout)
    finally:
        raw.close()


def test_a_spoiled_key_neither_skews_the_byte_count_nor_blocks_eviction(layout, make_store, redis_server):
    capacity = 2 * record_bytes(layout)
    store = make_store(layout, capacity)
    store.store(blocks(layout, [1, 2]))
    raw = redis.Redis.from_url(redis_server.url)
    try:
        raw.delete(store.key_of(block_hash(1)))
        raw.rpush(store.key_of(block_hash(1)), b"x")  # the least recently used key, now a list
        store.store(blocks(layout, [3]))  # evicts it
        assert raw.exists(store.key_of(block_hash(1))) == 0
        assert store.load_prefix(hashes(2)) == [payload(layout, 2)] and store.load_prefix(hashes(3)) != []
        assert store.snapshot().used_bytes == capacity
    finally:
        raw.close()


def test_with_a_secret_forged_records_are_misses_deleted_and_stored_again(make_store, redis_server):
    layout = keyed_layout()
    store = make_store(layout)
    store.store(blocks(layout, [1, 2]))
    raw = redis.Redis.from_url(redis_server.url)
    try:
        for forger_secret in (None, b"a guessed secret of some length"):
            forged = encode_record(forger(layout, forger_secret), block_hash(2), payload(layout, 9))
            raw.set(store.key_of(block_hash(2)), forged)
            assert store.load_prefix(hashes(1, 2)) == [payload(layout, 1)]
            assert raw.exists(store.key_of(block_hash(2))) == 0
            store.store(blocks(layout, [2]))
            assert store.load_prefix(hashes(1, 2)) == [payload(layout, 1), payload(layout, 2)]
    finally:
        raw.close()
    assert store.snapshot().bad_records == 2


def test_redis_down_at_start_serves_misses_then_is_used_when_it_comes_back(layout, redis_server, caplog):
    redis_server.stop()
    clock = FakeClock()
    with caplog.at_level(logging.WARNING):
        store = RedisStore(layout, redis_server.url, 2**20, clock=clock, retry_initial_s=1.0)
    try:
        assert not store.available
        store.store(blocks(layout, [1]))
        assert store.load_prefix(hashes(1)) == []
        assert "unavailable" in caplog.text
        redis_server.start()
        clock.now = 0.5
        assert not store.available  # still backing off
        clock.now = 1.0
        assert store.available
        store.store(blocks(layout, [1]))
        assert store.load_prefix(hashes(1)) == [payload(layout, 1)]
    finally:
        store.close()


def test_redis_killed_mid_run_and_restarted(layout, redis_server, caplog):
    clock = FakeClock()
    store = RedisStore(layout, redis_server.url, 2**20, clock=clock, retry_initial_s=1.0, retry_max_s=4.0)
    host = HostMemoryStore(layout, 2**20)
    try:
        store.store(blocks(layout, [1]))
        assert store.load_prefix(hashes(1)) == [payload(layout, 1)]
        redis_server.stop()
        with caplog.at_level(logging.WARNING):
            assert store.load_prefix(hashes(1)) == []
            assert not store.available
            store.store(blocks(layout, [2]))  # dropped at once, no second warning
        assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
        errors = store.snapshot().errors
        host.store(blocks(layout, [2]))  # other tiers are unaffected
        assert host.load_prefix(hashes(2)) == [payload(layout, 2)]

        clock.now = 1.0  # a retry while still down backs off further: next one at 1 + 2
        assert not store.available
        assert store.snapshot().errors == errors + 1
        redis_server.start()
        clock.now = 2.5
        assert not store.available
        clock.now = 3.0
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert store.available
        assert "reachable again" in caplog.text
        assert store.load_prefix(hashes(1)) == []  # the restarted server kept nothing
        store.store(blocks(layout, [1, 2]))
        assert store.load_prefix(hashes(1, 2)) == [payload(layout, 1), payload(layout, 2)]
    finally:
        store.close()


def exercise(store, layout) -> None:
    """Every script the tier runs, on a store with room for three blocks: store with eviction, lookup, count,
    removal."""
    store.store(blocks(layout, [1, 2, 3, 4]))  # evicts 1
    assert store.load_prefix(hashes(2, 3)) == [payload(layout, 2), payload(layout, 3)]
    assert store.held_prefix(hashes(4, 1)) == hashes(4)
    store.discard(hashes(4))
    assert store.load_prefix(hashes(4)) == []
    store.store(blocks(layout, [5]))
    stats = store.snapshot()
    assert stats.available and stats.errors == 0 and (stats.num_blocks, stats.evictions) == (3, 1)


@pytest.mark.parametrize("who", ["default-user", "acl-user", "password-from-the-engine"])
def test_a_password_or_an_acl_user_in_the_url_connects(layout, secured_redis, who, caplog):
    credentials = {
        "default-user": f":{secured_redis.password}",
        "acl-user": f"{secured_redis.user}:{secured_redis.user_password}",
        "password-from-the-engine": secured_redis.user,
    }[who]
    password = secured_redis.user_password if who == "password-from-the-engine" else None
    url = secured_redis.url(credentials)
    store = RedisStore(layout, url, 3 * record_bytes(layout), password=password)
    try:
        exercise(store, layout)
    finally:
        store.close()


@pytest.mark.parametrize(
    "credentials", ["", "prefixcache:wrong-password", ":wrong-password"], ids=["none", "wrong-user-password", "wrong"]
)
def test_without_the_right_password_the_tier_is_unavailable_and_no_password_is_logged(
    layout, secured_redis, credentials, caplog
):
    with caplog.at_level(logging.WARNING):
        store = RedisStore(layout, secured_redis.url(credentials), 2**20)
    try:
        store.store(blocks(layout, [1]))
        assert not store.available and store.load_prefix(hashes(1)) == []
    finally:
        store.close()
    assert "unavailable" in caplog.text
    assert "wrong-password" not in caplog.text and (not credentials or ":***@" in caplog.text)


def test_tls_with_the_ca_and_a_client_certificate_connects(layout, secured_redis):
    url = secured_redis.url(f":{secured_redis.password}", tls=True, query=secured_redis.tls_files)
    store = RedisStore(layout, url, 3 * record_bytes(layout))
    try:
        exercise(store, layout)
    finally:
        store.close()


@pytest.mark.parametrize(
    ("tls", "query"),
    [
        (True, "without-the-ca"),
        (True, "without-a-client-certificate"),
        (False, "plain-text-to-the-tls-port"),
    ],
)
def test_tls_that_cannot_be_verified_leaves_the_tier_unavailable(layout, secured_redis, tls, query, caplog):
    files = secured_redis
    options = {
        "without-the-ca": f"ssl_certfile={files.client_cert}&ssl_keyfile={files.client_key}",
        "without-a-client-certificate": f"ssl_ca_certs={files.ca}",
        "plain-text-to-the-tls-port": "",
    }[query]
    url = secured_redis.url(f":{secured_redis.password}", tls=True, query=options)
    if not tls:
        url = url.replace("rediss://", "redis://")
    with caplog.at_level(logging.WARNING):
        store = RedisStore(layout, url, 2**20, timeout_s=5.0)
    try:
        assert not store.available
    finally:
        store.close()
    assert "unavailable" in caplog.text and secured_redis.password not in caplog.text


def test_eviction_follows_priority_and_an_expired_block_is_never_loaded(layout, make_store):
    clock = WallClock()
    check_retention_order(make_store(layout, 3 * retained_record_bytes(layout), wall_clock=clock), layout, clock)


def test_a_24h_block_is_kept_with_a_key_expiry_of_24_hours(layout, make_store, redis_server):
    store = make_store(layout)
    store.store(blocks(layout, [1, 2]), {block_hash(1): (90, 86400.0)})
    raw = redis.Redis.from_url(redis_server.url)
    try:
        assert 86390 * 1000 < raw.pttl(store.key_of(block_hash(1))) <= 86400 * 1000
        assert raw.pttl(store.key_of(block_hash(2))) == -1  # no directive: kept until evicted
    finally:
        raw.close()
    assert store.load_prefix(hashes(1, 2)) == [payload(layout, 1), payload(layout, 2)]


def test_a_block_redis_expired_gives_its_bytes_back(layout, make_store, redis_server):
    store = make_store(layout, 3 * retained_record_bytes(layout))
    store.store(blocks(layout, [1]), {block_hash(1): (90, RETAINED[1])})
    raw = redis.Redis.from_url(redis_server.url)
    try:
        raw.pexpire(store.key_of(block_hash(1)), 1)  # as if Redis's clock ran ahead of the engine's
        while raw.exists(store.key_of(block_hash(1))):
            raw.pexpire(store.key_of(block_hash(1)), 1)
    finally:
        raw.close()
    store.store(blocks(layout, [1, 2, 3]))
    assert store.snapshot().num_blocks == 3
    assert store.load_prefix(hashes(1, 2, 3)) == [payload(layout, i) for i in (1, 2, 3)]
