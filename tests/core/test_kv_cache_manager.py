"""KVCacheManager semantics that schedulers and users rely on, with exact block ids and eviction order."""

import pytest

from prefixcache.core import KVCacheManager, PrefixHit, Request
from tests.core.conftest import BLOCK_SIZE, FakeConnector, admit, make_request, manager_state, unique_tokens


def test_first_request_takes_exactly_the_blocks_it_needs_in_id_order(manager):
    req = make_request(range(10))
    assert manager.find_prefix(req).num_tokens == 0
    new = manager.allocate_slots(req, 10)
    assert [b.block_id for b in new] == [0, 1, 2]
    assert manager.block_ids(req) == [[0, 1, 2]]
    assert manager.num_free_blocks == 7
    assert manager.usage == pytest.approx(0.3)
    assert [b.block_hash is not None for b in new] == [True, True, False]  # partial last block not cached
    manager.check_invariants()


def test_shared_prefix_hits_full_blocks_and_takes_references(manager):
    a = make_request(list(range(8)) + [100, 101])
    admit(manager, a)
    b = make_request(list(range(8)) + [200, 201, 202])
    hit = manager.find_prefix(b)
    num_cached = hit.num_tokens
    assert hit.block_ids() == [[0, 1]]
    assert num_cached == 8
    manager.allocate_slots(b, b.num_tokens - num_cached, hit)
    assert manager.block_ids(b) == [[0, 1, 3]]
    assert [manager.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    manager.check_invariants()


def test_lookup_changes_no_state(manager):
    admit(manager, make_request(range(12)))
    before = manager_state(manager)
    manager.find_prefix(make_request(range(12)))
    assert manager_state(manager) == before


def test_hit_stops_at_first_miss(manager):
    admit(manager, make_request(range(12)))
    tokens = list(range(12))
    tokens[5] = 999  # second block differs, so the third cannot be reused either
    assert [b.block_id for b in manager.find_prefix(make_request(tokens + [1])).blocks[0]] == [0]


def test_full_hit_is_capped_so_the_last_token_is_computed(manager):
    a = make_request(range(12))
    admit(manager, a)
    hit = manager.find_prefix(make_request(range(12)))
    assert hit.num_tokens == 8 and hit.block_ids() == [[0, 1]]
    hit = manager.find_prefix(make_request(range(13)))
    assert hit.num_tokens == 12 and hit.block_ids() == [[0, 1, 2]]


def test_free_returns_blocks_and_evicts_lru_first_and_tail_before_parent():
    mgr = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    a = make_request(unique_tokens(8, 0))  # blocks 0, 1
    b = make_request(unique_tokens(8, 100))  # blocks 2, 3
    admit(mgr, a)
    admit(mgr, b)
    mgr.free(a)
    mgr.free(b)
    assert mgr.num_free_blocks == 6
    # 4, 5 never held a prefix: reused first; then a's tail (1), a's head (0), b's tail (3), b's head (2)
    c = make_request(unique_tokens(24, 1000))
    assert [blk.block_id for blk in mgr.allocate_slots(c, 24)] == [4, 5, 1, 0, 3, 2]
    mgr.check_invariants()


def test_eviction_drops_the_prefix_from_the_index():
    mgr = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    a = make_request(unique_tokens(8, 0))
    admit(mgr, a)
    mgr.free(a)
    admit(mgr, make_request(unique_tokens(9, 500)))  # needs 3 blocks: 2, then evicts 1 (a's tail), then 0
    mgr.check_invariants()
    assert mgr.find_prefix(make_request(unique_tokens(8, 0) + [7])).num_tokens == 0


def test_a_hit_refreshes_recency():
    mgr = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request(unique_tokens(4, 0) + [1])  # block 0 cached, 1 partial
    b = make_request(unique_tokens(4, 100) + [1])  # block 2 cached, 3 partial
    admit(mgr, a)
    admit(mgr, b)
    mgr.free(a)
    mgr.free(b)
    again = make_request(unique_tokens(4, 0) + [2])  # hits a's block 0, freed last now
    assert admit(mgr, again) == 4
    mgr.free(again)
    # `again` reused partial block 1 and freed it after 3; then b's block 2, then block 0 (refreshed)
    c = make_request(unique_tokens(16, 900))
    assert [blk.block_id for blk in mgr.allocate_slots(c, 16)] == [3, 1, 2, 0]


def test_partial_blocks_are_reused_before_cached_ones():
    mgr = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    a = make_request(unique_tokens(6, 0))  # block 0 full (cached), block 1 partial
    admit(mgr, a)
    mgr.free(a)
    c = make_request(unique_tokens(3, 50))
    assert [blk.block_id for blk in mgr.allocate_slots(c, 3)] == [2]
    d = make_request(unique_tokens(3, 60))
    assert [blk.block_id for blk in mgr.allocate_slots(d, 3)] == [1]  # partial, not the cached block 0
    assert mgr.find_prefix(make_request(unique_tokens(6, 0))).num_tokens == 4


def test_chunked_prefill_caches_blocks_as_they_fill(manager):
    req = make_request(range(14))
    assert [b.block_id for b in manager.allocate_slots(req, 6)] == [0, 1]
    assert req.num_computed_tokens == 6
    other = make_request(range(14))
    assert manager.find_prefix(other).num_tokens == 4  # block 0 full and cached, block 1 half done
    assert [b.block_id for b in manager.allocate_slots(req, 6)] == [2]
    assert manager.find_prefix(other).num_tokens == 12
    assert [b.block_id for b in manager.allocate_slots(req, 2)] == [3]
    assert req.num_computed_tokens == 14
    manager.check_invariants()


def test_decode_filling_a_block_caches_it(manager):
    req = make_request(range(6))
    admit(manager, req)
    req.append_output_token_ids([50])
    assert manager.allocate_slots(req, 1) == []
    req.append_output_token_ids([51])
    assert manager.allocate_slots(req, 1) == []  # tokens 0..7: block 1 is full now
    follow_up = make_request([*range(6), 50, 51, 60])
    hit = manager.find_prefix(follow_up)
    num_cached = hit.num_tokens
    assert num_cached == 8 and hit.block_ids() == [[0, 1]]
    req.append_output_token_ids([52])
    assert [b.block_id for b in manager.allocate_slots(req, 1)] == [2]


def test_lookahead_allocates_ahead_without_caching(manager):
    req = make_request(range(4))
    assert [b.block_id for b in manager.allocate_slots(req, 4, num_lookahead_tokens=5)] == [0, 1, 2]
    assert sum(b.block_hash is not None for b in manager.pool.blocks) == 1


def test_identical_blocks_filled_independently_are_both_kept(manager):
    a, b = make_request(range(9)), make_request(range(9))
    hits_a = manager.find_prefix(a)
    n_a = hits_a.num_tokens
    hits_b = manager.find_prefix(b)
    n_b = hits_b.num_tokens  # both looked up before either was admitted
    manager.allocate_slots(a, 9 - n_a, hits_a)
    manager.allocate_slots(b, 9 - n_b, hits_b)
    assert manager.block_ids(a) == [[0, 1, 2]] and manager.block_ids(b) == [[3, 4, 5]]
    manager.check_invariants()
    c = make_request(range(9))
    assert [blk.block_id for blk in manager.find_prefix(c).blocks[0]] == [0, 1]  # the first cached
    manager.free(a)
    manager.free(b)
    manager.check_invariants()
    assert manager.num_free_blocks == 10


def test_duplicate_survives_eviction_of_the_first_copy():
    mgr = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a, b = make_request(range(4)), make_request(range(4))
    mgr.allocate_slots(a, 4)
    mgr.allocate_slots(b, 4)
    mgr.free(a)  # block 0 evictable, block 1 (b's copy) still in use
    mgr.allocate_slots(make_request(unique_tokens(9, 100)), 9)  # takes 2, 3, then evicts 0
    mgr.check_invariants()
    assert [blk.block_id for blk in mgr.find_prefix(make_request(range(5))).blocks[0]] == [1]


def test_salts_never_share_blocks(manager):
    admit(manager, make_request(range(9), cache_salt="tenant-a"))
    assert manager.find_prefix(make_request(range(9), cache_salt="tenant-b")).num_tokens == 0
    assert manager.find_prefix(make_request(range(9))).num_tokens == 0
    assert manager.find_prefix(make_request(range(9), cache_salt="tenant-a")).num_tokens == 8


def test_lora_adapters_never_share_blocks_and_do_not_collide_with_salts(manager):
    admit(manager, make_request(range(9), lora_name="x"))
    assert manager.find_prefix(make_request(range(9), lora_name="y")).num_tokens == 0
    assert manager.find_prefix(make_request(range(9), cache_salt="x")).num_tokens == 0
    assert manager.find_prefix(make_request(range(9), lora_name="x")).num_tokens == 8


def test_disabled_caching_hashes_nothing_and_never_hits():
    mgr = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=False)
    a = make_request(range(9))
    admit(mgr, a)
    assert a.block_hashes == []
    assert mgr.find_prefix(make_request(range(9))).num_tokens == 0
    assert mgr.block_ids(a) == [[0, 1, 2]]
    mgr.free(a)
    assert admit(mgr, make_request(range(9))) == 0
    assert mgr.stats.hits == 0
    mgr.check_invariants()


def test_reset_is_refused_while_in_use_then_forgets_everything(manager):
    a = make_request(range(9))
    admit(manager, a)
    assert manager.reset_prefix_cache() is False
    assert manager.find_prefix(make_request(range(9))).num_tokens == 8  # nothing was dropped
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.find_prefix(make_request(range(9))).num_tokens == 0
    assert manager.num_free_blocks == 10
    assert [b.block_id for b in manager.allocate_slots(make_request(range(3)), 3)] == [0]
    manager.check_invariants()


def test_allocation_failure_returns_none_and_changes_nothing():
    mgr = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    a = make_request(range(9))
    admit(mgr, a)
    mgr.free(a)  # blocks 0, 1 cached and evictable
    b = make_request(range(12))
    admit(mgr, b)  # 0, 1 hit, new block 3 caches tokens 8..11
    big = make_request(list(range(8)) + unique_tokens(12, 50))
    hit = mgr.find_prefix(big)
    num_cached = hit.num_tokens
    assert num_cached == 8
    before = manager_state(mgr)
    assert mgr.allocate_slots(big, 12, hit) is None  # needs 3 new blocks, 2 free
    assert manager_state(mgr) == before
    assert big.num_computed_tokens == 0
    b.append_output_token_ids(list(range(9)))
    assert mgr.allocate_slots(b, 9) is None
    assert manager_state(mgr) == before and b.num_computed_tokens == 12


def test_watermark_holds_back_admission_but_not_running_requests():
    mgr = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, watermark=0.2)  # keep 2 blocks free
    a = make_request(unique_tokens(32, 0))
    assert mgr.allocate_slots(a, 32) is not None  # 8 blocks, 2 left
    assert mgr.allocate_slots(make_request(unique_tokens(1, 99)), 1) is None
    a.append_output_token_ids([1])
    assert mgr.allocate_slots(a, 1) is not None  # a running request may eat into the watermark


def test_skip_reading_prefix_cache_still_writes_it(manager):
    admit(manager, make_request(range(9)))
    reader = make_request(range(9), skip_reading_prefix_cache=True)
    assert manager.find_prefix(reader).num_tokens == 0
    manager.allocate_slots(reader, 9)
    assert manager.block_ids(reader) == [[3, 4, 5]]
    fresh = make_request(range(9))
    assert manager.find_prefix(fresh).num_tokens == 8


def test_stats_count_each_request_once_at_admission(manager):
    a = make_request(range(9))
    admit(manager, a)
    b = make_request(range(9))
    manager.find_prefix(b)  # a lookup alone does not count
    assert (manager.stats.requests, manager.stats.queries, manager.stats.hits) == (1, 9, 0)
    admit(manager, b)
    assert (manager.stats.requests, manager.stats.queries, manager.stats.hits) == (2, 18, 8)
    assert manager.stats.hit_rate == pytest.approx(8 / 18)
    manager.free(b)  # preempted, then re-admitted: counted apart, since it re-reads its own blocks
    admit(manager, b)
    assert manager.stats.requests == 2 and manager.stats.hits == 8
    stats = manager.stats
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 9, 8)


def test_preempted_request_hits_its_own_surviving_blocks(manager):
    req = make_request(range(6))
    admit(manager, req)
    req.append_output_token_ids([7, 8, 9])
    manager.allocate_slots(req, 1)
    manager.allocate_slots(req, 1)
    manager.free(req)
    assert req.num_computed_tokens == 0
    assert manager.find_prefix(req).num_tokens == 8  # prompt and generated tokens 0..7, both blocks


def test_misuse_is_a_clear_error_and_changes_nothing(manager):
    a = make_request(range(9))
    before = manager_state(manager)
    with pytest.raises(ValueError, match="has 9"):
        manager.allocate_slots(a, 10)
    with pytest.raises(ValueError, match=">= 0"):
        manager.allocate_slots(a, -1)
    with pytest.raises(ValueError, match="does not match"):
        manager.allocate_slots(a, 5, PrefixHit([[]], num_local_tokens=4))
    assert manager_state(manager) == before
    manager.free(make_request(range(3)))  # never admitted: nothing to free
    assert manager_state(manager) == before


def test_stale_lookup_is_rejected():
    mgr = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    a = make_request(unique_tokens(4, 0) + [1])
    admit(mgr, a)
    mgr.free(a)
    b = make_request(unique_tokens(4, 0) + [2])
    hit = mgr.find_prefix(b)
    num_cached = hit.num_tokens
    assert num_cached == 4
    admit(mgr, make_request(unique_tokens(12, 100)))  # evicts the block b looked up
    with pytest.raises(ValueError, match="look it up again"):
        mgr.allocate_slots(b, 1, hit)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": 4, "block_size": 0}, "block_size"),
        ({"num_blocks": 4, "watermark": 1.0}, "watermark"),
        ({"num_blocks": 4, "hash_algo": "md5"}, "hash algorithm"),
        ({"num_blocks": 4, "eviction_policy": "random"}, "eviction policy"),
    ],
)
def test_bad_configuration_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVCacheManager(**kwargs)


def test_bad_requests_are_clear_errors():
    with pytest.raises(ValueError, match="empty"):
        make_request([])
    with pytest.raises(ValueError, match="cache_salt"):
        make_request([1], cache_salt="")
    with pytest.raises(ValueError, match="request_id"):
        make_request([1], request_id="")


def two_blocks_on_the_device_two_on_a_tier(connector: FakeConnector) -> tuple[KVCacheManager, Request]:
    """A manager over ``connector`` and a 17-token request whose first two blocks are cached on the device (freed
    by an earlier request) and whose next two the connector holds."""
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, connector=connector)
    first = make_request(unique_tokens(9, 0))
    admit(manager, first)
    manager.free(first)
    request = make_request(unique_tokens(17, 0))
    connector.held_hashes.update(manager.block_hashes(request)[2:4])
    return manager, request


def test_external_tokens_get_new_blocks_count_as_hits_and_become_findable():
    """Blocks a connector loads: allocated like new tokens, counted like cached ones, then cached."""
    connector = FakeConnector()
    manager, request = two_blocks_on_the_device_two_on_a_tier(connector)
    hit = manager.find_prefix(request)
    assert (hit.num_local_tokens, hit.num_external_tokens) == (2 * BLOCK_SIZE, 2 * BLOCK_SIZE)
    new = manager.allocate_slots(request, 1, hit)
    assert [b.block_id for b in new] == [3, 4, 5] and request.num_computed_tokens == 17
    assert connector.loads == [(2, (3,)), (3, (4,))]  # block index, its block in each group
    assert (manager.stats.queries, manager.stats.hits) == (9 + 17, 4 * BLOCK_SIZE)
    same = make_request(unique_tokens(17, 0))
    connector.held_hashes.clear()
    assert manager.find_prefix(same).num_tokens == 4 * BLOCK_SIZE  # the loaded blocks are cached now
    manager.check_invariants()


@pytest.mark.parametrize(
    ("num_external", "match"),
    [(3, "whole blocks"), (3 * BLOCK_SIZE, "at least one token")],
)
def test_external_tokens_misuse_is_refused(num_external, match):
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, connector=FakeConnector())
    request = make_request(unique_tokens(3 * BLOCK_SIZE, 0))
    with pytest.raises(ValueError, match=match):
        manager.allocate_slots(request, 0, PrefixHit([[]], num_external_tokens=num_external))
    assert manager.allocate_slots(request, request.num_tokens) is not None
    with pytest.raises(ValueError, match="already admitted"):
        manager.allocate_slots(request, 0, PrefixHit([[]], num_external_tokens=BLOCK_SIZE))


def test_external_tokens_need_a_connector():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request(unique_tokens(3 * BLOCK_SIZE, 0))
    with pytest.raises(ValueError, match="connector"):
        manager.allocate_slots(request, 0, PrefixHit([[]], num_external_tokens=BLOCK_SIZE))


def test_device_hit_tokens_is_the_device_hit_without_asking_the_connector_and_changes_nothing():
    """What a scheduler ranks waiting requests by: the hit find_prefix finds on the device, capped so the last
    token is computed, with the tiers' blocks left out (never read or staged) and no state moved."""

    class CountingConnector(FakeConnector):
        asked = 0

        def extend_hit(self, request, block_hashes, start, end) -> int:
            self.asked += 1
            return super().extend_hit(request, block_hashes, start, end)

    connector = CountingConnector()
    manager, request = two_blocks_on_the_device_two_on_a_tier(connector)
    before, asked = manager_state(manager), connector.asked
    assert manager.device_hit_tokens(request) == 2 * BLOCK_SIZE  # the tiers' two blocks are not counted
    assert connector.asked == asked and manager_state(manager) == before
    assert manager.device_hit_tokens(make_request(unique_tokens(8, 0))) == BLOCK_SIZE  # the last token computed
    assert manager.device_hit_tokens(make_request(unique_tokens(17, 100))) == 0
    assert manager.device_hit_tokens(make_request(unique_tokens(17, 0), skip_reading_prefix_cache=True)) == 0
    assert manager.find_prefix(request).num_tokens == 4 * BLOCK_SIZE and connector.asked == asked + 1
