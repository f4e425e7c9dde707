"""The connector's scheduler side without a model, through the cache manager it is given to: how far tiers
extend a hit, what each step's plan loads and saves in either mode, promotion between tiers, the tiers'
events, and a cache of several KV cache groups."""

import pytest

from prefixcache.core import KVCacheGroupSpec, KVCacheManager, Request, root_hash
from prefixcache.core.miss import hittable_blocks
from prefixcache.core.retention import RetentionRange
from prefixcache.offload import DiskStore, HostMemoryStore
from prefixcache.offload.connector import WRITE_BACK, WRITE_THROUGH, OffloadConnector, TierWriter
from tests.core.conftest import FakeClock
from tests.offload.conftest import make_layout
from tests.offload.test_host import Recorder

B = 4
SLIDING = KVCacheGroupSpec(sliding_window=2 * B)  # a query sees the 7 tokens before it: 2 blocks


def make_request(n_tokens: int, start: int = 1000, request_id: str = "r") -> Request:
    return Request(request_id, list(range(start, start + n_tokens)))


def make_connector(
    num_blocks=8, mode=WRITE_BACK, tiers=("cpu",), tmp_path=None, tier_listeners=(), groups=None, **manager_kwargs
):
    layout = make_layout(root_hash=root_hash("sha256"), block_size=B)
    stores = [
        HostMemoryStore(layout, 100 * layout.block_bytes)
        if tier == "cpu"
        else DiskStore(layout, tmp_path / "disk", 100 * 2 * layout.block_bytes)
        for tier in tiers
    ]
    writer = TierWriter(stores, background=False)
    group_args = {} if groups is None else {"groups": groups}
    connector = OffloadConnector(stores, B, mode, writer, tier_listeners=tier_listeners, **group_args)
    manager = KVCacheManager(num_blocks=num_blocks, block_size=B, connector=connector, **group_args, **manager_kwargs)
    return manager, connector, layout


def kv(layout, block_hash) -> bytes:
    """A payload that names its block, so a mixed-up load is caught."""
    return (block_hash * (layout.block_bytes // len(block_hash) + 1))[: layout.block_bytes]


def put(connector, layout, tier, hashes):
    connector.stores[tier].store([(h, kv(layout, h)) for h in hashes])


def admit(manager, request):
    """What the scheduler does: find the prefix, admit the whole prompt; (device tokens, tier tokens)."""
    hit = manager.find_prefix(request)
    assert manager.allocate_slots(request, request.num_tokens - hit.num_tokens, hit) is not None
    return hit.num_local_tokens, hit.num_external_tokens


def take_plan(manager):
    return manager.take_transfers()[1]


def staged_blocks(manager, connector, request) -> int:
    """What the tiers hold for ``request`` right after block 0, read and staged as admission would."""
    hashes = manager.block_hashes(request)
    return connector.extend_hit(request, hashes, 0, hittable_blocks(request.num_tokens, B))


def cache_on_device(manager, connector, num_tokens: int) -> None:
    """Run and free a request of the first ``num_tokens`` tokens: its full blocks stay cached on the device."""
    first = make_request(num_tokens, request_id="first")
    admit(manager, first)
    take_plan(manager)
    manager.free(first)


def test_tiers_extend_the_device_hit_run_by_run_in_tier_order(tmp_path):
    """Each run starts in the first tier holding the next block and goes on as far as that tier can."""
    manager, connector, layout = make_connector(num_blocks=16, tiers=("cpu", "disk"), tmp_path=tmp_path)
    request = make_request(7 * B + 1)
    hashes = manager.block_hashes(request)
    put(connector, layout, 0, [hashes[0], hashes[2], hashes[4], hashes[6]])
    put(connector, layout, 1, [hashes[1], hashes[2], hashes[3], hashes[5]])
    assert admit(manager, request) == (0, 7 * B)
    plan = take_plan(manager)
    assert [load.tier for load in plan.loads] == [0, 1, 1, 1, 0, 1, 0]
    [table] = manager.block_ids(request)
    assert [(load.block_ids, load.payload) for load in plan.loads] == [
        ((table[i],), kv(layout, hashes[i])) for i in range(7)
    ]
    stats = connector.stats()
    assert (stats[0].hit_tokens, stats[1].hit_tokens) == (3 * B, 4 * B)


def test_the_lookup_leaves_the_last_prompt_token_to_compute():
    manager, connector, layout = make_connector()
    request = make_request(3 * B)
    put(connector, layout, 0, manager.block_hashes(request))
    assert admit(manager, request) == (0, 2 * B)


def test_tiers_continue_after_the_device_hit():
    manager, connector, layout = make_connector(num_blocks=16)
    cache_on_device(manager, connector, 2 * B + 1)
    request = make_request(5 * B + 1)
    hashes = manager.block_hashes(request)
    put(connector, layout, 0, hashes[2:4])
    assert admit(manager, request) == (2 * B, 2 * B)
    assert [load.block_hash for load in take_plan(manager).loads] == hashes[2:4]


def test_nothing_is_read_for_a_request_that_skips_the_cache():
    manager, connector, layout = make_connector()
    request = Request("r", list(range(9)), skip_reading_prefix_cache=True)
    put(connector, layout, 0, manager.block_hashes(request))
    assert manager.find_prefix(request).num_tokens == 0
    assert connector.stats()[0].hits == 0  # not even read


def test_blocks_read_for_a_waiting_request_stay_until_it_is_admitted_or_finished():
    manager, connector, layout = make_connector()
    request = make_request(3 * B + 1)
    put(connector, layout, 0, manager.block_hashes(request))
    assert manager.find_prefix(request).num_external_tokens == 3 * B
    connector.stores[0].discard(manager.block_hashes(request))  # gone from the tier meanwhile
    assert manager.find_prefix(request).num_external_tokens == 3 * B  # what was read is still good
    manager.free(request)  # it leaves without being admitted
    assert manager.find_prefix(request).num_external_tokens == 0


def test_write_through_saves_computed_blocks_after_the_forward_pass_but_not_loaded_ones():
    manager, connector, layout = make_connector(mode=WRITE_THROUGH)
    request = make_request(4 * B + 1)
    hashes = manager.block_hashes(request)
    put(connector, layout, 0, hashes[:2])
    admit(manager, request)
    plan = take_plan(manager)
    [table] = manager.block_ids(request)
    assert [(s.block_ids, s.block_hash, s.tiers) for s in plan.save_after] == [
        ((table[i],), hashes[i], (0,)) for i in (2, 3)
    ]
    assert plan.save_before == []


def test_write_back_saves_the_last_copy_before_the_device_reuses_it():
    manager, _, _ = make_connector(num_blocks=4)
    first = make_request(3 * B + 1, request_id="first")
    admit(manager, first)
    assert not take_plan(manager)  # nothing to save while the device holds everything
    [table] = manager.block_ids(first)
    manager.free(first)
    second = make_request(2 * B, start=5000, request_id="second")
    admit(manager, second)
    plan = take_plan(manager)
    hashes = manager.block_hashes(first)
    # the uncached partial block goes first, then the tail of the freed prompt
    assert [(s.block_ids, s.block_hash, s.tiers) for s in plan.save_before] == [((table[2],), hashes[2], (0,))]
    assert plan.save_after == []


def test_write_back_hands_loaded_blocks_to_the_device_and_promotes_into_write_through_tiers(tmp_path):
    for mode, host_keeps in ((WRITE_BACK, False), (WRITE_THROUGH, True)):
        manager, connector, layout = make_connector(mode=mode, tiers=("cpu", "disk"), tmp_path=tmp_path / mode)
        request = make_request(2 * B + 1)
        hashes = manager.block_hashes(request)
        put(connector, layout, 0, hashes[:1])
        put(connector, layout, 1, hashes[1:2])
        admit(manager, request)
        host = connector.stores[0]
        assert (hashes[0] in host, hashes[1] in host) == (host_keeps, host_keeps), mode


def test_a_partial_device_hit_is_kept_unless_the_tiers_beat_it():
    manager, connector, layout = make_connector(num_blocks=16, sub_block_size=2)
    first = make_request(2 * B + 3, request_id="first")  # blocks 0, 1 full; block 2 holds 3 written tokens
    admit(manager, first)
    manager.index_written_sub_blocks()
    manager.free(first)
    request = make_request(4 * B + 1)
    hit = manager.find_prefix(request)
    assert (hit.num_local_tokens, hit.num_copied_tokens, hit.num_external_tokens) == (2 * B + 2, 2, 0)
    assert hit.block_ids() == [[0, 1, 2]]  # block 2 is the copy source
    found = manager.lookup(request.prompt_token_ids)
    assert (found.cached_tokens_by_tier, found.copied_tokens) == ({"device": 2 * B + 2, "CPU": 0}, 2)
    put(connector, layout, 0, manager.block_hashes(request)[2:3])
    manager.free(request)  # drops what was staged, so the next lookup reads the tier again
    hit = manager.find_prefix(request)
    assert (hit.num_local_tokens, hit.num_copied_tokens, hit.num_external_tokens) == (2 * B, 0, B)
    assert hit.block_ids() == [[0, 1]]
    found = manager.lookup(request.prompt_token_ids)
    assert (found.cached_tokens_by_tier, found.copied_tokens) == ({"device": 2 * B, "CPU": B}, 0)


def test_a_lookup_splits_the_hit_by_tier_as_admission_takes_it_and_reads_nothing(tmp_path):
    manager, connector, layout = make_connector(num_blocks=16, tiers=("cpu", "disk"), tmp_path=tmp_path)
    cache_on_device(manager, connector, 2 * B + 1)
    request = make_request(6 * B + 1)  # blocks 0-1 on the device, 2 on the host, 3-4 on disk, 5 nowhere
    hashes = manager.block_hashes(request)
    put(connector, layout, 0, hashes[2:3])
    put(connector, layout, 1, hashes[3:5])
    before = connector.stats()
    found = manager.lookup(request.prompt_token_ids)
    assert found.cached_tokens_by_tier == {"device": 2 * B, "CPU": B, "DISK": 2 * B}
    assert (found.cached_tokens, found.cached_prefix_end, found.first_miss_reason) == (5 * B, 5 * B, "new")
    assert found.missed_tokens == {
        "new": B,
        "evicted": 0,
        "expired": 0,
        "evicted_below_retained": 0,
        "partial_block": 1,
        "skipped": 0,
        "no_checkpoint": 0,
    }
    assert connector.stats() == before and not take_plan(manager)  # nothing read, staged or planned
    assert admit(manager, request) == (2 * B, 3 * B)


def test_tier_events_reach_listeners_with_their_medium_when_the_step_is_planned(tmp_path):
    recorder = Recorder()
    manager, connector, layout = make_connector(tiers=("cpu", "disk"), tmp_path=tmp_path, tier_listeners=[recorder])
    request = make_request(2 * B + 1)
    hashes = manager.block_hashes(request)
    put(connector, layout, 0, hashes[:1])
    put(connector, layout, 1, hashes[1:2])
    admit(manager, request)
    assert recorder.events == []  # held until the scheduler plans the step
    take_plan(manager)
    assert recorder.events == [
        ("stored", "CPU", hashes[:1], B),
        ("stored", "DISK", hashes[1:2], B),
        ("removed", "CPU", hashes[:1]),  # write-back: the device holds it now
    ]


def test_misuse_is_refused(tmp_path):
    with pytest.raises(ValueError, match="blocks of 4 tokens"):
        OffloadConnector([HostMemoryStore(make_layout(), 2**20)], 8)
    with pytest.raises(ValueError, match="mode"):
        OffloadConnector([HostMemoryStore(make_layout(block_size=8), 2**20)], 8, mode="eager")
    with pytest.raises(ValueError, match="at least one tier"):
        OffloadConnector([], 8)
    with pytest.raises(ValueError, match="write_back needs one KV cache group"):
        OffloadConnector([HostMemoryStore(make_layout(), 2**20)], 4, groups=[SLIDING, KVCacheGroupSpec()])


def test_with_a_sliding_group_each_load_and_save_names_the_block_of_every_group_that_has_one():
    """A tier record holds every layer: loaded into the full group's blocks, and into the sliding group's only
    inside the window before the hit's end; a computed block is saved from both groups' blocks."""
    manager, connector, layout = make_connector(num_blocks=30, mode=WRITE_THROUGH, groups=(KVCacheGroupSpec(), SLIDING))
    request = make_request(6 * B + 1)
    hashes = manager.block_hashes(request)
    put(connector, layout, 0, hashes[:5])
    assert admit(manager, request) == (0, 5 * B)
    # Tokens 20.. are computed; their queries read 13.. on: the sliding group needs blocks 3 and 4 only.
    assert manager.block_ids(request) == [[1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 8, 9, 10, 11]]
    plan = take_plan(manager)
    assert [(load.block_ids, load.block_hash) for load in plan.loads] == [
        ((1, None), hashes[0]),
        ((2, None), hashes[1]),
        ((3, None), hashes[2]),
        ((4, 8), hashes[3]),
        ((5, 9), hashes[4]),
    ]
    assert [(s.block_ids, s.block_hash) for s in plan.save_after] == [((6, 10), hashes[5])]
    manager.check_invariants()


def retained_connector(mode, num_blocks=4, min_priority=0):
    """A manager and its connector on one fake clock (the device pool's), with a host tier on another."""
    clock = FakeClock()
    layout = make_layout(root_hash=root_hash("sha256"), block_size=B)
    host = HostMemoryStore(layout, 100 * layout.block_bytes)
    writer = TierWriter([host], background=False)
    connector = OffloadConnector([host], B, mode, writer, clock=clock, min_priority=min_priority)
    manager = KVCacheManager(num_blocks=num_blocks, block_size=B, connector=connector, clock=clock)
    return manager, connector, clock


def test_write_back_demotes_a_retained_block_with_the_time_its_ttl_has_left():
    manager, _, clock = retained_connector(WRITE_BACK)
    first = Request("first", list(range(1000, 1000 + 3 * B + 1)), retention=(RetentionRange(0, 2 * B, 90, 60.0),))
    admit(manager, first)
    take_plan(manager)
    manager.free(first)
    clock.advance(20)
    admit(manager, make_request(4 * B - 1, start=5000, request_id="second"))  # takes every block
    hashes = manager.block_hashes(first)
    saved = {s.block_hash: s.retention for s in take_plan(manager).save_before}
    assert saved == {hashes[0]: (90, 40.0), hashes[1]: (90, 40.0), hashes[2]: None}


def test_an_expired_block_is_demoted_at_the_default_priority():
    manager, _, clock = retained_connector(WRITE_BACK)
    first = Request("first", list(range(1000, 1000 + 2 * B)), retention=(RetentionRange(0, 2 * B, 90, 60.0),))
    admit(manager, first)
    take_plan(manager)
    manager.free(first)
    clock.advance(61)
    admit(manager, make_request(4 * B - 1, start=5000, request_id="second"))
    saved = {s.block_hash: s.retention for s in take_plan(manager).save_before}
    assert saved == dict.fromkeys(manager.block_hashes(first)[:2])


def test_write_through_hands_a_24h_block_its_whole_ttl():
    manager, _, _ = retained_connector(WRITE_THROUGH, num_blocks=8)
    request = Request("r", list(range(1000, 1000 + 3 * B + 1)), retention=(RetentionRange(0, 2 * B, 90, 86400.0),))
    admit(manager, request)
    hashes = manager.block_hashes(request)
    assert [(s.block_hash, s.retention) for s in take_plan(manager).save_after] == [
        (hashes[0], (90, 86400.0)),
        (hashes[1], (90, 86400.0)),
        (hashes[2], None),
    ]


# Three blocks of one prompt at priorities 90, 20 and the default 35 (the last two blocks).
MIXED = (RetentionRange(0, B, 90, 60.0), RetentionRange(B, 2 * B, 20, 60.0))


@pytest.mark.parametrize(("min_priority", "kept"), [(0, [0, 1, 2]), (21, [0, 2]), (36, [0])])
def test_write_back_drops_the_blocks_below_the_minimum_priority_instead_of_demoting_them(min_priority, kept):
    manager, _, _ = retained_connector(WRITE_BACK, min_priority=min_priority)
    first = Request("first", list(range(1000, 1000 + 3 * B + 1)), retention=MIXED)
    admit(manager, first)
    take_plan(manager)
    manager.free(first)
    admit(manager, make_request(4 * B - 1, start=5000, request_id="second"))  # evicts every block of the first
    hashes = manager.block_hashes(first)
    assert sorted(hashes.index(s.block_hash) for s in take_plan(manager).save_before) == kept


@pytest.mark.parametrize(("min_priority", "kept"), [(0, [0, 1, 2]), (35, [0, 2]), (90, [0]), (91, [])])
def test_write_through_saves_only_the_blocks_at_the_minimum_priority(min_priority, kept):
    manager, _, _ = retained_connector(WRITE_THROUGH, num_blocks=8, min_priority=min_priority)
    request = Request("r", list(range(1000, 1000 + 3 * B + 1)), retention=MIXED)
    admit(manager, request)
    hashes = manager.block_hashes(request)
    assert [hashes.index(s.block_hash) for s in take_plan(manager).save_after] == kept
