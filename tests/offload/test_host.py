"""Host memory tier: exact round trips, longest-run lookups, LRU within a byte budget, CPU events."""

import pytest

from prefixcache.offload import HostMemoryStore, TierEventListener
from prefixcache.offload.record import state_key
from tests.offload.conftest import (
    WallClock,
    block_hash,
    blocks,
    check_held_prefix_reads_nothing,
    check_retention_order,
    make_layout,
    payload,
)


class Recorder(TierEventListener):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def tier_blocks_stored(self, medium, block_hashes, block_size):
        self.events.append(("stored", medium, list(block_hashes), block_size))

    def tier_blocks_removed(self, medium, block_hashes):
        self.events.append(("removed", medium, list(block_hashes)))


def test_round_trip_is_exact_and_stops_at_the_first_missing_block(layout):
    store = HostMemoryStore(layout, capacity_bytes=10 * layout.block_bytes)
    store.store(blocks(layout, [0, 1, 3]))
    assert store.load_prefix([block_hash(i) for i in (0, 1, 2, 3)]) == [payload(layout, 0), payload(layout, 1)]
    assert store.load_prefix([block_hash(2), block_hash(3)]) == []
    stats = store.snapshot()
    assert (stats.blocks_stored, stats.hits, stats.num_blocks) == (3, 2, 3)
    assert stats.bytes_stored == 3 * layout.block_bytes and stats.used_bytes == 3 * layout.block_bytes


def test_capacity_evicts_the_least_recently_used(layout):
    store = HostMemoryStore(layout, capacity_bytes=3 * layout.block_bytes + 5)
    recorder = Recorder()
    store.add_listener(recorder)
    store.store(blocks(layout, [1, 2, 3]))
    assert store.load_prefix([block_hash(1)]) == [payload(layout, 1)]  # 1 is now the most recent
    store.store(blocks(layout, [4]))
    assert [h for h in map(block_hash, (1, 2, 3, 4)) if h in store] == [block_hash(i) for i in (1, 3, 4)]
    store.store(blocks(layout, [5, 6]))
    assert [h for h in map(block_hash, range(1, 7)) if h in store] == [block_hash(i) for i in (4, 5, 6)]
    assert recorder.events == [
        ("stored", "CPU", [block_hash(i) for i in (1, 2, 3)], layout.block_size),
        ("stored", "CPU", [block_hash(4)], layout.block_size),
        ("removed", "CPU", [block_hash(2)]),
        ("stored", "CPU", [block_hash(5), block_hash(6)], layout.block_size),
        ("removed", "CPU", [block_hash(3), block_hash(1)]),
    ]
    assert store.snapshot().evictions == 3


def test_checkpoints_count_their_own_size_against_the_budget():
    """A state checkpoint of three blocks' size in a budget of four blocks pushes out the least recently used
    block, not a block count's worth."""
    layout = make_layout(state_bytes=3 * make_layout().block_bytes)
    store = HostMemoryStore(layout, capacity_bytes=4 * layout.block_bytes)
    store.store(blocks(layout, [1, 2]))
    checkpoint = (state_key(block_hash(2)), bytes(range(256)) * (layout.state_bytes // 256))
    store.store([checkpoint])
    assert [block_hash(1) in store, block_hash(2) in store, checkpoint[0] in store] == [False, True, True]
    assert store.load_prefix([checkpoint[0]]) == [checkpoint[1]]
    stats = store.snapshot()
    assert (stats.used_bytes, stats.num_blocks, stats.evictions) == (4 * layout.block_bytes, 2, 1)
    assert stats.bytes_stored == 5 * layout.block_bytes
    store.discard([checkpoint[0]])
    assert store.snapshot().used_bytes == layout.block_bytes


def test_held_prefix_reads_nothing_and_leaves_the_lru_order(layout):
    check_held_prefix_reads_nothing(HostMemoryStore(layout, capacity_bytes=3 * layout.block_bytes), layout)


def test_storing_a_held_block_again_keeps_one_copy_and_refreshes_it(layout):
    store = HostMemoryStore(layout, capacity_bytes=2 * layout.block_bytes)
    store.store(blocks(layout, [1, 2]))
    store.store(blocks(layout, [1]))
    store.store(blocks(layout, [3]))
    assert block_hash(1) in store and block_hash(2) not in store
    assert store.snapshot().blocks_stored == 3


def test_payload_of_the_wrong_size_is_misuse(layout):
    store = HostMemoryStore(layout, capacity_bytes=layout.block_bytes)
    with pytest.raises(ValueError, match="payload has"):
        store.store([(block_hash(1), b"x")])
    with pytest.raises(ValueError, match="capacity"):
        HostMemoryStore(layout, capacity_bytes=0)


def test_eviction_follows_priority_and_an_expired_block_is_never_loaded(layout):
    clock = WallClock()
    check_retention_order(HostMemoryStore(layout, 3 * layout.block_bytes + 5, wall_clock=clock), layout, clock)
