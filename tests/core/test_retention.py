"""Retention directives in the cache: exact eviction order under priorities and TTLs (a fake clock), the bounds
(retained share, tenant quota, largest TTL), tenants kept apart, preemption, reset and the retained accounting."""

import pytest

from prefixcache.core import KVCacheManager, RetentionRange
from prefixcache.core.block_pool import PRIORITY_CLASSES
from prefixcache.core.eviction import EXPIRED
from prefixcache.core.miss import RetentionRun
from prefixcache.core.retention import DEFAULT_PRIORITY, BlockDirective, block_directives, check_retention
from tests.core.conftest import BLOCK_SIZE, FakeClock, admit, make_request, manager_state, unique_tokens


def retention_manager(num_blocks=12, **kwargs) -> tuple[KVCacheManager, FakeClock]:
    clock = FakeClock()
    kwargs.setdefault("max_retention_ttl_s", 1000.0)
    return KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, clock=clock, **kwargs), clock


def run(mgr, tokens, retention=(), **kwargs):
    """Admit a whole prompt with its directives and free it at once; returns the request."""
    request = make_request(tokens, retention=retention, **kwargs)
    admit(mgr, request)
    mgr.free(request)
    return request


def order(mgr) -> list[int]:
    return [block.block_id for block in mgr.pool.eviction_order()]


def new_block_ids(mgr, num_tokens, start) -> list[int]:
    request = make_request(unique_tokens(num_tokens, start))
    admit(mgr, request)
    return mgr.block_ids(request)[0]


def test_free_blocks_leave_expired_first_then_lowest_priority_then_lru():
    mgr, clock = retention_manager()
    run(mgr, range(8), [RetentionRange(0, priority=80, ttl_s=100)])  # blocks 0, 1
    run(mgr, range(100, 108))  # 2, 3: default
    run(mgr, range(200, 208), [RetentionRange(0, priority=10)])  # 4, 5: low, for the largest TTL
    run(mgr, range(300, 308), [RetentionRange(0, priority=80, ttl_s=10)])  # 6, 7
    assert order(mgr) == [5, 4, 3, 2, 1, 0, 7, 6]  # low, default, retained; LRU (tail first) within each
    clock.advance(11)  # 6 and 7's TTL ended while they were free
    assert order(mgr) == [7, 6, 5, 4, 3, 2, 1, 0]
    assert mgr.pool.blocks[7].priority == EXPIRED
    assert new_block_ids(mgr, 24, 1000) == [8, 9, 10, 11, 7, 6]  # never-cached blocks, then the expired
    assert new_block_ids(mgr, 8, 2000) == [5, 4]
    assert new_block_ids(mgr, 8, 3000) == [3, 2]
    assert new_block_ids(mgr, 8, 4000) == [1, 0]
    counters = mgr.pool.retention_counters
    assert counters.expirations == {"expired": 0, "low": 0, "default": 0, "retained": 2}
    assert counters.evictions == {"expired": 2, "low": 2, "default": 2, "retained": 2}
    mgr.check_invariants()


def test_without_directives_the_order_and_block_ids_are_plain_lru():
    mgr, _ = retention_manager()
    plain = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE)
    for m in (mgr, plain):
        for start in (0, 100, 200):
            run(m, range(start, start + 8))
    assert order(mgr) == [b.block_id for b in plain.pool.evictable] == [1, 0, 3, 2, 5, 4]
    assert new_block_ids(mgr, 32, 1000) == new_block_ids(plain, 32, 1000)
    assert mgr.pool.retention_counters.evictions["default"] == 2


def test_a_ttl_runs_from_the_last_use_and_its_end_returns_the_block_to_the_default_priority():
    mgr, clock = retention_manager()
    a = make_request(range(9), retention=[RetentionRange(0, priority=90, ttl_s=100)])
    admit(mgr, a)
    clock.advance(500)  # in use all that time: a TTL never ends under a request
    mgr.free(a)
    assert mgr.pool.blocks[0].expires_at == clock.now + 100
    clock.advance(60)
    b = run(mgr, range(9))  # a plain hit is a use: the TTL starts again when it is freed
    assert b.num_retained_read_tokens == 8
    assert mgr.pool.blocks[0].expires_at == clock.now + 100
    clock.advance(99)
    assert order(mgr)[-2:] == [1, 0] and mgr.pool.blocks[0].priority == 90
    clock.advance(1)
    assert order(mgr)[:2] == [1, 0] and mgr.pool.blocks[0].priority == EXPIRED
    c = run(mgr, range(9))  # hit after the TTL: the block is back at the default priority
    assert mgr.pool.blocks[0].priority == DEFAULT_PRIORITY and c.num_retained_read_tokens == 0
    assert 0 in [block.block_id for block in mgr.pool.evictable]
    assert mgr.pool.retention_counters.hits["expired"] == 2
    mgr.check_invariants()


def test_a_hit_with_another_directive_replaces_the_blocks_retention():
    mgr, _ = retention_manager()
    run(mgr, range(8), [RetentionRange(0, priority=90, ttl_s=50)])
    run(mgr, range(8), [RetentionRange(0, 4, priority=20, ttl_s=70)])  # the same tenant lowers block 0
    assert [(b.priority, b.ttl_s) for b in mgr.pool.blocks[:3]] == [(20, 70), (90, 50), (DEFAULT_PRIORITY, 0.0)]
    assert order(mgr) == [0, 2, 1]  # block 2: the second request's own copy of the last block (its last token runs)


def test_the_retained_share_demotes_the_oldest_retained_and_the_response_says_so():
    mgr, _ = retention_manager(num_blocks=10, max_retained_fraction=0.4)  # 4 retained blocks
    a = run(mgr, range(8), [RetentionRange(0, priority=80)])
    b = run(mgr, range(100, 108), [RetentionRange(0, priority=80)])
    c = run(mgr, range(200, 208), [RetentionRange(0, priority=80)])
    assert a.retention_clamped == b.retention_clamped == [] and c.retention_clamped == ["max_retained_fraction"]
    assert list(mgr.pool.retained) == [3, 2, 5, 4]
    assert [mgr.pool.blocks[i].priority for i in (0, 1)] == [DEFAULT_PRIORITY] * 2
    assert order(mgr) == [1, 0, 3, 2, 5, 4]  # a's demoted blocks go like any default block
    mgr.check_invariants()


def test_an_allocation_never_fails_because_of_retained_blocks():
    mgr, _ = retention_manager(num_blocks=10, max_retained_fraction=1.0)
    for start in range(0, 500, 100):
        run(mgr, range(start, start + 8), [RetentionRange(0, priority=100)])
    assert len(mgr.pool.retained) == 10 and mgr.num_free_blocks == 10
    assert sorted(new_block_ids(mgr, 40, 1000)) == list(range(10))
    mgr.check_invariants()


def test_a_tenant_past_its_quota_loses_its_own_oldest_retained_blocks_only():
    mgr, _ = retention_manager(num_blocks=10, max_tenant_retained_fraction=0.2)  # 2 blocks a tenant
    run(mgr, range(8), [RetentionRange(0, priority=80)], tenant="B")
    a1 = run(mgr, range(100, 108), [RetentionRange(0, priority=80)], tenant="A")
    a2 = run(mgr, range(200, 208), [RetentionRange(0, priority=80)], tenant="A")
    assert a1.retention_clamped == [] and a2.retention_clamped == ["max_tenant_retained_fraction"]
    assert mgr.pool.retained_blocks_by_tenant() == {"B": 2, "A": 2}
    assert [mgr.pool.blocks[i].tenant for i in (1, 0, 3, 2, 5, 4)] == ["B", "B", None, None, "A", "A"]
    mgr.check_invariants()


def test_a_ttl_past_the_operators_largest_is_clamped_and_reported():
    mgr, clock = retention_manager(max_retention_ttl_s=100.0)
    a = run(mgr, range(8), [RetentionRange(0, priority=80, ttl_s=3600)])
    assert a.retention_clamped == ["max_retention_ttl_s"]
    assert mgr.pool.blocks[0].ttl_s == 100.0
    b = run(mgr, range(100, 108), [RetentionRange(0, priority=80)])  # no TTL: the largest, not a clamp
    assert b.retention_clamped == [] and mgr.pool.blocks[2].ttl_s == 100.0
    clock.advance(100)
    assert order(mgr) == [1, 0, 3, 2] and mgr.pool.retention_counters.expirations["retained"] == 4


def test_tenants_salted_apart_never_touch_each_others_blocks():
    mgr, _ = retention_manager(num_blocks=12)
    prefix = list(range(8))
    run(mgr, prefix + [1], [RetentionRange(0, priority=90)], tenant="A", cache_salt="tenant-A")
    b = run(mgr, prefix + [1], [RetentionRange(0, priority=0)], tenant="B", cache_salt="tenant-B")
    assert b.num_retained_read_tokens == 0 and mgr.block_ids(b) == [[]]
    assert [(mgr.pool.blocks[i].priority, mgr.pool.blocks[i].tenant) for i in (0, 1)] == [(90, "A")] * 2
    for start in range(100, 900, 100):  # B floods the cache with unique prompts
        run(mgr, range(start, start + 16), tenant="B", cache_salt="tenant-B")
    a = make_request(prefix + [1], tenant="A", cache_salt="tenant-A")
    assert admit(mgr, a) == 8  # A's prefix survived the flood
    mgr.check_invariants()


def test_a_directive_on_a_block_another_tenant_marked_leaves_it_as_it_is():
    mgr, _ = retention_manager()
    run(mgr, range(9), [RetentionRange(0, priority=90, ttl_s=60)], tenant="A")
    b = run(mgr, range(9), [RetentionRange(0, priority=0)], tenant="B")  # a shared salt: B hits A's blocks
    assert b.num_retained_read_tokens == 8
    assert [(mgr.pool.blocks[i].priority, mgr.pool.blocks[i].tenant) for i in (0, 1)] == [(90, "A")] * 2


def test_preemption_keeps_retained_blocks_and_counts_each_token_once():
    mgr, _ = retention_manager()
    a = make_request(range(10), retention=[RetentionRange(0, priority=80)])
    admit(mgr, a)
    assert (a.num_retained_written_tokens, a.num_retained_read_tokens) == (8, 0)
    mgr.free(a)  # preempted
    assert order(mgr) == [1, 0] and mgr.pool.blocks[0].priority == 80
    assert admit(mgr, a) == 8  # resumed on its own retained blocks
    assert (a.num_retained_written_tokens, a.num_retained_read_tokens) == (8, 0)
    mgr.free(a)
    b = run(mgr, range(10))
    assert (b.num_retained_written_tokens, b.num_retained_read_tokens) == (0, 8)
    assert (mgr.stats.retained_written_tokens, mgr.stats.retained_read_tokens) == (8, 8)
    mgr.check_invariants()


def test_reset_forgets_every_retention():
    mgr, clock = retention_manager()
    run(mgr, range(8), [RetentionRange(0, priority=80, ttl_s=5)], tenant="A")
    running = make_request(range(100, 108), retention=[RetentionRange(0, priority=80)])
    admit(mgr, running)
    assert not mgr.reset_prefix_cache()  # refused while a block is in use: nothing changed
    assert len(mgr.pool.retained) == 4
    mgr.free(running)
    assert mgr.reset_prefix_cache()
    assert all(b.priority == DEFAULT_PRIORITY and b.tenant is None for b in mgr.pool.blocks)
    assert not mgr.pool.retained and not mgr.pool.retained_free and order(mgr) == []
    clock.advance(10)  # the expiries of forgotten blocks are gone with them
    mgr.pool.expire()
    assert mgr.pool.retention_counters.expirations["retained"] == 0
    assert admit(mgr, make_request(range(9))) == 0
    mgr.check_invariants()


def test_written_tokens_count_prompt_tokens_of_retained_blocks_as_they_fill():
    mgr, _ = retention_manager()
    a = make_request(range(10), retention=[RetentionRange(0, priority=80)])  # to the end, output included
    admit(mgr, a)
    assert a.num_retained_written_tokens == 8  # tokens 8, 9 are in a block that is not full yet
    a.append_output_token_ids([1, 2])
    mgr.allocate_slots(a, 2)
    assert a.num_retained_written_tokens == 10 and mgr.pool.blocks[2].priority == 80


def test_written_tokens_are_counted_by_the_ttl_their_blocks_are_kept_for():
    """What Anthropic's ``cache_creation`` splits by TTL: the prompt tokens of each written block, by its TTL (the
    last block's prompt tokens only, once it fills)."""
    mgr, _ = retention_manager()
    ranges = [RetentionRange(0, 8, priority=80, ttl_s=3600), RetentionRange(8, priority=80, ttl_s=300)]
    a = make_request(range(10), retention=ranges)
    admit(mgr, a)
    assert a.num_retained_written_tokens_by_ttl == {1000: 8}  # 1h, cut to the largest TTL (1000 s)
    a.append_output_token_ids([1, 2])
    mgr.allocate_slots(a, 2)
    assert a.num_retained_written_tokens_by_ttl == {1000: 8, 300: 2}
    assert a.num_retained_written_tokens == 10
    mgr.free(a)
    b = run(mgr, range(12), ranges)  # reads a's first two blocks, writes its own third (a's holds a's output)
    assert (b.num_retained_read_tokens, b.num_retained_written_tokens_by_ttl) == (8, {300: 4})


def test_a_breakpoint_covers_only_the_blocks_wholly_before_it():
    mgr, _ = retention_manager()
    a = run(mgr, range(11), [RetentionRange(2, 10, priority=80)])
    assert [mgr.pool.blocks[i].priority for i in (0, 1)] == [DEFAULT_PRIORITY, 80]
    assert a.num_retained_written_tokens == 4


@pytest.mark.parametrize(
    ("ranges", "expected"),
    [
        ([RetentionRange(0, 16, priority=80, ttl_s=5)], ((0, 4, 80, 5),)),
        ([RetentionRange(3, 13, priority=80)], ((1, 3, 80, 1000.0),)),  # whole blocks only
        ([RetentionRange(1, 4, priority=80)], ()),  # no whole block inside
        ([RetentionRange(0, priority=DEFAULT_PRIORITY, ttl_s=9)], ()),  # the default: nothing to do
        (  # overlapping: the highest priority first, then the longest TTL
            [RetentionRange(0, 8, priority=50, ttl_s=5), RetentionRange(0, priority=90), RetentionRange(0, 4, 90, 9)],
            ((0, None, 90, 1000.0), (0, 1, 90, 9), (0, 2, 50, 5)),
        ),
    ],
)
def test_block_directives(ranges, expected):
    directives, clamped = block_directives(ranges, BLOCK_SIZE, 1000.0)
    assert directives == tuple(BlockDirective(*d) for d in expected) and not clamped


def test_a_range_past_the_prompt_is_refused():
    with pytest.raises(ValueError, match=r"retention range 4\.\.9 is past the prompt of 8 tokens"):
        make_request(range(8), retention=[RetentionRange(4, 9)])
    with pytest.raises(ValueError, match=r"retention range 8\.\.the end is past"):
        check_retention([RetentionRange(8)], 8)
    with pytest.raises(ValueError, match="RetentionRange values"):
        make_request(range(8), retention=[(0, 4)])


def test_counters_cover_every_priority_class():
    mgr, _ = retention_manager()
    counters = mgr.pool.retention_counters
    assert set(counters.hits) == set(counters.evictions) == set(counters.expirations) == set(PRIORITY_CLASSES)


def test_a_lookup_shows_the_retention_of_the_cached_prefix_and_changes_nothing():
    mgr, clock = retention_manager()
    run(mgr, range(13), [RetentionRange(0, 8, priority=90, ttl_s=100)])
    clock.advance(40)
    before = manager_state(mgr)
    found = mgr.lookup(list(range(13)))
    assert manager_state(mgr) == before
    assert found.retention == [RetentionRun(0, 8, 90, 100, 60.0), RetentionRun(8, 12, DEFAULT_PRIORITY)]
    in_use = make_request(range(9))
    admit(mgr, in_use)  # a TTL does not run under a request
    assert mgr.lookup(list(range(13))).retention[0] == RetentionRun(0, 8, 90, 100, None)
    mgr.free(in_use)
    clock.advance(100)
    assert mgr.lookup(list(range(13))).retention == [RetentionRun(0, 12, DEFAULT_PRIORITY)]  # its TTL ended


def test_a_hot_retained_block_freed_again_and_again_keeps_the_expiry_heap_bounded():
    mgr, clock = retention_manager()
    run(mgr, range(13), [RetentionRange(0, 8, priority=90, ttl_s=100)])
    for _ in range(3000):  # each free pushes an expiry; the hit before it makes the last one stale
        clock.advance(0.01)
        run(mgr, range(9))
    queue = mgr.pool.retained_free
    assert len(queue._expiries) <= 4 * len(queue) + 1024
    clock.advance(99.9)
    assert order(mgr)[-2:] == [1, 0]
    clock.advance(0.2)
    assert order(mgr)[:2] == [1, 0] and mgr.pool.retention_counters.expirations["retained"] == 2
    mgr.check_invariants()
