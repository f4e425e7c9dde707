"""The ``shared`` retention rule: which blocks it raises (exact ids), when they fall back, what it leaves alone."""

import pytest

from prefixcache.core import KVCacheManager, RetentionRange
from prefixcache.core.eviction import EXPIRED
from prefixcache.core.retention import DEFAULT_PRIORITY
from prefixcache.core.retention_rules import RETENTION_RULES, SharedPrefixRetention, make_retention_rule
from tests.core.conftest import BLOCK_SIZE, FakeClock, admit, make_request

RAISED = SharedPrefixRetention.PRIORITY
TTL = SharedPrefixRetention.TTL_S


def shared_manager(num_blocks=12, **kwargs) -> tuple[KVCacheManager, FakeClock]:
    clock = FakeClock()
    mgr = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, clock=clock, retention_rule="shared", **kwargs)
    return mgr, clock


def run(mgr, tokens, **kwargs):
    """Admit a whole prompt and free it at once; returns the request."""
    request = make_request(tokens, **kwargs)
    admit(mgr, request)
    mgr.free(request)
    return request


def priorities(mgr, block_ids) -> list[int]:
    return [mgr.pool.blocks[i].priority for i in block_ids]


def order(mgr) -> list[int]:
    return [block.block_id for block in mgr.pool.eviction_order()]


def test_a_prefix_the_second_request_reaches_is_raised_and_its_own_blocks_are_not():
    mgr, _ = shared_manager()
    run(mgr, [*range(8), 900])  # blocks 0, 1 cached; 2 holds the partial last block
    assert priorities(mgr, [0, 1]) == [DEFAULT_PRIORITY] * 2  # one request reached them
    run(mgr, [*range(8), *range(500, 504), 901])  # hits 0, 1; fills 3 with its own block (4: partial)
    assert priorities(mgr, [0, 1, 3]) == [RAISED, RAISED, DEFAULT_PRIORITY]
    run(mgr, [*range(100, 108), 902])  # 5, 6: fresh, default
    assert order(mgr) == [3, 6, 5, 1, 0]  # default (LRU, tail first), then the shared prefix
    assert mgr.retention_rule.reach_count(mgr.pool.blocks[0].block_hash) == 2
    mgr.check_invariants()


def test_shared_blocks_fall_back_when_their_ttl_ends_and_rise_again_when_reached():
    mgr, clock = shared_manager()
    run(mgr, [*range(8), 900])
    run(mgr, [*range(8), 901])  # 0, 1 raised, freed now: their TTL starts
    run(mgr, [*range(100, 108), 902])  # 4, 5 (2 and 3 held the partial last blocks)
    clock.advance(TTL - 1)
    assert order(mgr) == [5, 4, 1, 0]
    clock.advance(2)  # the TTL ended while they were free: expired, evicted before the default blocks
    assert order(mgr) == [1, 0, 5, 4]
    assert priorities(mgr, [0, 1]) == [EXPIRED, EXPIRED]
    third = make_request([*range(8), 903])
    admit(mgr, third)  # a third request reaches them: raised again
    assert priorities(mgr, [0, 1]) == [RAISED, RAISED]
    mgr.free(third)
    assert order(mgr) == [5, 4, 1, 0]
    mgr.check_invariants()


def test_reaches_are_counted_across_an_eviction():
    mgr, _ = shared_manager(num_blocks=4)
    first = run(mgr, [*range(8), 900])  # blocks 0, 1
    run(mgr, [*range(100, 112), 901])  # needs all 4 blocks: 0 and 1 are evicted
    assert mgr.find_prefix(make_request([*range(8), 902])).num_tokens == 0
    again = make_request([*range(8), 903])
    admit(mgr, again)  # computes the prefix again: the record says one request reached it before
    assert [mgr.pool.blocks[i].block_hash for i in mgr.block_ids(again)[0][:2]] == first.block_hashes[:2]
    assert priorities(mgr, mgr.block_ids(again)[0][:2]) == [RAISED, RAISED]


def test_the_record_forgets_the_least_recently_reached_hashes_beyond_its_size():
    mgr, _ = shared_manager(num_blocks=4)
    rule = mgr.retention_rule
    assert rule.history_size == SharedPrefixRetention.HISTORY_FACTOR * 4
    first = run(mgr, [*range(8), 900])
    for i in range(8):  # 16 hashes more, each reached once
        run(mgr, [*range(1000 + 8 * i, 1008 + 8 * i), 901])
    assert rule.reach_count(first.block_hashes[0]) == 0
    again = make_request([*range(8), 902])
    admit(mgr, again)
    assert priorities(mgr, mgr.block_ids(again)[0][:2]) == [DEFAULT_PRIORITY] * 2  # counted as a first reach


def test_a_request_admitted_again_after_a_preemption_does_not_count_twice():
    mgr, _ = shared_manager()
    request = make_request([*range(8), 900])
    admit(mgr, request)
    mgr.free(request)  # preempted
    assert admit(mgr, request) == 8  # re-reads its own blocks
    assert priorities(mgr, [0, 1]) == [DEFAULT_PRIORITY] * 2
    assert mgr.retention_rule.reach_count(request.block_hashes[0]) == 1


def test_a_users_directive_is_left_as_it_is():
    mgr, _ = shared_manager()
    run(mgr, [*range(8), 900], retention=(RetentionRange(0, 4, priority=90, ttl_s=50),))  # block 0 at 90
    run(mgr, [*range(8), *range(200, 204), 901], retention=(RetentionRange(4, 8, priority=10),))  # block 1 at 10
    assert priorities(mgr, [0, 1]) == [90, 10]
    run(mgr, [*range(8), 902])
    assert priorities(mgr, [0, 1]) == [90, 10]


def test_a_tenants_shared_blocks_are_its_own_marks_which_its_directives_replace():
    mgr, _ = shared_manager(max_tenant_retained_fraction=0.25)  # 3 blocks a tenant
    run(mgr, [*range(8), 900], tenant="a")
    run(mgr, [*range(8), 901], tenant="a")
    assert [(b.priority, b.tenant) for b in mgr.pool.blocks[:2]] == [(RAISED, "a")] * 2
    assert mgr.pool.retained_blocks_by_tenant() == {"a": 2}
    run(mgr, [*range(8), 902], tenant="a", retention=(RetentionRange(0, 8, priority=90, ttl_s=50),))
    assert priorities(mgr, [0, 1]) == [90, 90]
    second_prefix = run(mgr, [*range(100, 112), 903], tenant="a")  # 3 blocks more of a's, shared next
    run(mgr, [*range(100, 112), 904], tenant="a")
    assert len(second_prefix.block_hashes) == 3
    assert mgr.pool.retained_blocks_by_tenant() == {"a": 3}  # its quota bounds the rule's marks too


def test_shared_blocks_stay_within_the_retained_share():
    mgr, _ = shared_manager(max_retained_fraction=0.25)  # 3 of 12 blocks
    for start in (0, 100):
        run(mgr, [*range(start, start + 8), 900])
        run(mgr, [*range(start, start + 8), 901])
    # 0, 1 shared first, then 4, 5: block 1 (freed before 0, tail first) was the least recently used, demoted
    assert [b.block_id for b in mgr.pool.blocks if b.priority == RAISED] == [0, 4, 5]
    assert list(mgr.pool.retained) == [0, 5, 4]  # least recently used first
    assert order(mgr)[-3:] == [0, 5, 4]


def test_a_reset_forgets_what_was_shared():
    mgr, _ = shared_manager()
    first = run(mgr, [*range(8), 900])
    assert mgr.reset_prefix_cache()
    assert mgr.retention_rule.reach_count(first.block_hashes[0]) == 0


def test_no_rule_by_default_and_bad_names_are_clear_errors():
    assert KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE).retention_rule is None
    uncached = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, retention_rule="shared", enable_caching=False)
    assert uncached.retention_rule is None
    assert list(RETENTION_RULES) == ["shared"]
    with pytest.raises(ValueError, match="unknown retention rule 'sticky'; choose one of shared"):
        KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, retention_rule="sticky")
    pool = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE).pool
    assert isinstance(make_retention_rule("shared", pool), SharedPrefixRetention)
    for bad, message in (
        ({"min_requests": 1}, "min_requests"),
        ({"priority": DEFAULT_PRIORITY}, "priority"),
        ({"ttl_s": 0}, "ttl_s"),
        ({"max_ttl_s": 0}, "max_ttl_s"),
        ({"history_factor": 0}, "history_factor"),
    ):
        with pytest.raises(ValueError, match=message):
            SharedPrefixRetention(pool, **bad)


def test_the_ttl_stays_within_the_operators_largest():
    mgr, clock = shared_manager(max_retention_ttl_s=60)  # below the rule's 600 s
    run(mgr, [*range(8), 900])
    run(mgr, [*range(8), 901])  # 0, 1 raised, for 60 s
    assert [(b.priority, b.ttl_s) for b in mgr.pool.blocks[:2]] == [(RAISED, 60)] * 2
    run(mgr, [*range(100, 108), 902])  # 4, 5
    clock.advance(59)
    assert order(mgr) == [5, 4, 1, 0]
    clock.advance(2)
    assert order(mgr) == [1, 0, 5, 4]
