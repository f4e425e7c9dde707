"""The connector's scheduler side without a model: how far tiers extend a hit, what each step's plan loads
and saves in either mode, promotion between tiers, and the tiers' events."""

import pytest

from prefixcache.core import KVCacheManager, Request
from prefixcache.offload import DiskStore, HostMemoryStore
from prefixcache.offload.connector import WRITE_BACK, WRITE_THROUGH, OffloadConnector, TierWriter
from tests.offload.conftest import make_layout
from tests.offload.test_host import Recorder

B = 4


def make_request(n_tokens: int, start: int = 1000, request_id: str = "r") -> Request:
    return Request(request_id, list(range(start, start + n_tokens)))


def make_connector(num_blocks=8, mode=WRITE_BACK, tiers=("cpu",), tmp_path=None, **manager_kwargs):
    manager = KVCacheManager(num_blocks=num_blocks, block_size=B, **manager_kwargs)
    layout = make_layout(root_hash=manager.root_hash, block_size=B)
    stores = [
        HostMemoryStore(layout, 100 * layout.block_bytes)
        if tier == "cpu"
        else DiskStore(layout, tmp_path / "disk", 100 * 2 * layout.block_bytes)
        for tier in tiers
    ]
    connector = OffloadConnector(manager, stores, mode, TierWriter(stores, background=False))
    return manager, connector, layout


def kv(layout, block_hash) -> bytes:
    """A payload that names its block, so a mixed-up load is caught."""
    return (block_hash * (layout.block_bytes // len(block_hash) + 1))[: layout.block_bytes]


def put(connector, layout, tier, hashes):
    connector.stores[tier].store([(h, kv(layout, h)) for h in hashes])


def admit(manager, connector, request):
    """What the scheduler does: lookup, extend, allocate everything, hand the connector the blocks."""
    blocks, num_cached = manager.get_computed_blocks(request)
    blocks, num_cached, num_external = connector.extend_local_hit(request, blocks, num_cached)
    num_new = request.num_tokens - num_cached - num_external
    new = manager.allocate_slots(request, num_new, num_cached, blocks, num_external_tokens=num_external)
    assert new is not None
    connector.update_state_after_alloc(request, manager.block_ids(request), num_external)
    return num_cached, num_external


def test_tiers_extend_the_device_hit_run_by_run_in_tier_order(tmp_path):
    """Each run starts in the first tier holding the next block and goes on as far as that tier can."""
    manager, connector, layout = make_connector(num_blocks=16, tiers=("cpu", "disk"), tmp_path=tmp_path)
    request = make_request(7 * B + 1)
    hashes = manager.block_hashes(request)
    put(connector, layout, 0, [hashes[0], hashes[2], hashes[4], hashes[6]])
    put(connector, layout, 1, [hashes[1], hashes[2], hashes[3], hashes[5]])
    assert admit(manager, connector, request) == (0, 7 * B)
    plan = connector.build_plan()
    assert [load.tier for load in plan.loads] == [0, 1, 1, 1, 0, 1, 0]
    table = manager.block_ids(request)
    assert [(load.block_id, load.payload) for load in plan.loads] == [
        (table[i], kv(layout, hashes[i])) for i in range(7)
    ]
    stats = connector.stats()
    assert (stats[0].hit_tokens, stats[1].hit_tokens) == (3 * B, 4 * B)


def test_the_lookup_leaves_the_last_prompt_token_to_compute():
    manager, connector, layout = make_connector()
    request = make_request(3 * B)
    put(connector, layout, 0, manager.block_hashes(request))
    assert admit(manager, connector, request) == (0, 2 * B)


def test_tiers_continue_after_the_device_hit():
    manager, connector, layout = make_connector(num_blocks=16)
    first = make_request(2 * B + 1, request_id="first")
    admit(manager, connector, first)
    connector.build_plan()
    manager.free(first)
    request = make_request(5 * B + 1)
    hashes = manager.block_hashes(request)
    put(connector, layout, 0, hashes[2:4])
    assert admit(manager, connector, request) == (2 * B, 2 * B)
    assert [load.block_hash for load in connector.build_plan().loads] == hashes[2:4]


def test_nothing_is_read_for_a_request_that_skips_the_cache():
    manager, connector, layout = make_connector()
    request = Request("r", list(range(9)), skip_reading_prefix_cache=True)
    put(connector, layout, 0, manager.block_hashes(request))
    assert connector.get_num_new_matched_tokens(request, 0) == 0


def test_blocks_read_for_a_waiting_request_stay_until_it_is_admitted_or_finished():
    manager, connector, layout = make_connector()
    request = make_request(3 * B + 1)
    put(connector, layout, 0, manager.block_hashes(request))
    assert connector.get_num_new_matched_tokens(request, 0) == 3 * B
    connector.stores[0].discard(manager.block_hashes(request))  # gone from the tier meanwhile
    assert connector.get_num_new_matched_tokens(request, 0) == 3 * B  # what was read is still good
    connector.request_finished(request)
    assert connector.get_num_new_matched_tokens(request, 0) == 0


def test_write_through_saves_computed_blocks_after_the_forward_pass_but_not_loaded_ones():
    manager, connector, layout = make_connector(mode=WRITE_THROUGH)
    request = make_request(4 * B + 1)
    hashes = manager.block_hashes(request)
    put(connector, layout, 0, hashes[:2])
    admit(manager, connector, request)
    plan = connector.build_plan()
    table = manager.block_ids(request)
    assert [(s.block_id, s.block_hash, s.tiers) for s in plan.save_after] == [
        (table[i], hashes[i], (0,)) for i in (2, 3)
    ]
    assert plan.save_before == []


def test_write_back_saves_the_last_copy_before_the_device_reuses_it():
    manager, connector, _ = make_connector(num_blocks=4)
    first = make_request(3 * B + 1, request_id="first")
    admit(manager, connector, first)
    assert not connector.build_plan()  # nothing to save while the device holds everything
    table = manager.block_ids(first)
    manager.free(first)
    second = make_request(2 * B, start=5000, request_id="second")
    admit(manager, connector, second)
    plan = connector.build_plan()
    hashes = manager.block_hashes(first)
    # the uncached partial block goes first, then the tail of the freed prompt
    assert [(s.block_id, s.block_hash, s.tiers) for s in plan.save_before] == [(table[2], hashes[2], (0,))]
    assert plan.save_after == []


def test_write_back_hands_loaded_blocks_to_the_device_and_promotes_into_write_through_tiers(tmp_path):
    for mode, host_keeps in ((WRITE_BACK, False), (WRITE_THROUGH, True)):
        manager, connector, layout = make_connector(mode=mode, tiers=("cpu", "disk"), tmp_path=tmp_path / mode)
        request = make_request(2 * B + 1)
        hashes = manager.block_hashes(request)
        put(connector, layout, 0, hashes[:1])
        put(connector, layout, 1, hashes[1:2])
        admit(manager, connector, request)
        host = connector.stores[0]
        assert (hashes[0] in host, hashes[1] in host) == (host_keeps, host_keeps), mode


def test_a_partial_device_hit_is_kept_unless_the_tiers_beat_it():
    manager, connector, layout = make_connector(num_blocks=16, sub_block_size=2)
    first = make_request(2 * B + 3, request_id="first")  # blocks 0, 1 full; block 2 holds 3 written tokens
    admit(manager, connector, first)
    manager.index_written_sub_blocks()
    manager.free(first)
    request = make_request(4 * B + 1)
    blocks, num_cached = manager.get_computed_blocks(request)
    assert num_cached == 2 * B + 2
    assert connector.extend_local_hit(request, blocks, num_cached) == (blocks, 2 * B + 2, 0)
    put(connector, layout, 0, manager.block_hashes(request)[2:3])
    extended = connector.extend_local_hit(request, blocks, num_cached)
    assert extended == (blocks[:2], 2 * B, B)


def test_tier_events_reach_listeners_with_their_medium_when_the_step_is_planned(tmp_path):
    manager, connector, layout = make_connector(tiers=("cpu", "disk"), tmp_path=tmp_path)
    recorder = Recorder()
    connector.add_listener(recorder)
    request = make_request(2 * B + 1)
    hashes = manager.block_hashes(request)
    put(connector, layout, 0, hashes[:1])
    put(connector, layout, 1, hashes[1:2])
    admit(manager, connector, request)
    assert recorder.events == []  # held until the scheduler plans the step
    connector.build_plan()
    assert recorder.events == [
        ("stored", "CPU", hashes[:1], B),
        ("stored", "DISK", hashes[1:2], B),
        ("removed", "CPU", hashes[:1]),  # write-back: the device holds it now
    ]


def test_misuse_is_refused(tmp_path):
    manager = KVCacheManager(num_blocks=4, block_size=8)
    with pytest.raises(ValueError, match="blocks of 4 tokens"):
        OffloadConnector(manager, [HostMemoryStore(make_layout(), 2**20)])
    with pytest.raises(ValueError, match="mode"):
        OffloadConnector(manager, [HostMemoryStore(make_layout(block_size=8), 2**20)], mode="eager")
    with pytest.raises(ValueError, match="at least one tier"):
        OffloadConnector(manager, [])
