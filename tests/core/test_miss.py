"""Why prompt tokens miss: the evicted-hash record, miss reasons counted at admission, and the lookup."""

import pytest

from prefixcache.core import EVICTION_POLICIES, MISS_REASONS, EvictedHashes, KVCacheManager, RetentionRange
from prefixcache.core.block_pool import BlockPoolListener
from tests.core.conftest import BLOCK_SIZE, FakeClock, admit, make_request, manager_state, unique_tokens


class EvictionRecorder(BlockPoolListener):
    def __init__(self) -> None:
        self.evicted: list = []
        self.causes: list[str] = []

    def blocks_removed(self, block_hashes, group) -> None:
        self.evicted.extend(block_hashes)

    def blocks_evicted(self, block_hashes, group, causes) -> None:
        assert block_hashes == self.evicted[-len(block_hashes) :]  # the same removal, told just after it
        self.causes.extend(causes or ["evicted"] * len(block_hashes))  # None: all plain


def missed(mgr: KVCacheManager) -> dict[str, int]:
    return {reason: n for reason, n in mgr.stats.missed_tokens.items() if n}


def run(mgr: KVCacheManager, tokens, **kwargs) -> int:
    """Admit a prompt, then finish it at once; returns the cached tokens it got."""
    request = make_request(tokens, **kwargs)
    num_cached = admit(mgr, request)
    mgr.free(request)
    return num_cached


def assert_reasons_add_up(mgr: KVCacheManager) -> None:
    stats = mgr.stats
    assert stats.queries == stats.hits + sum(stats.missed_tokens.values())


def evict(record: EvictedHashes, hashes: list[bytes], cause: str = "evicted") -> None:
    record.blocks_evicted(hashes, 0, None if cause == "evicted" else [cause] * len(hashes))


def test_record_remembers_at_least_the_last_capacity_evictions_and_at_most_twice_that():
    record = EvictedHashes(capacity=3)
    evict(record, [b"a", b"b"])
    evict(record, [b"c"])
    evict(record, [b"d", b"e"])
    assert set(record) == {b"a", b"b", b"c", b"d", b"e"}
    evict(record, [b"a"])  # evicted again: remembered anew; b and c have seen 4 later evictions
    assert set(record) == {b"a", b"d", b"e"}
    evict(record, [b"f", b"g", b"h"])
    assert b"a" not in record and set(record) == {b"f", b"g", b"h"}
    record.cache_cleared()
    assert len(record) == 0


def test_record_keeps_the_cause_of_each_hash_s_latest_eviction():
    record = EvictedHashes(capacity=2)
    record.blocks_evicted([b"a", b"b"], 0, ["expired", "evicted_below_retained"])  # fills a generation
    assert (record.cause(b"a"), record.cause(b"b"), record.cause(b"c")) == ("expired", "evicted_below_retained", None)
    evict(record, [b"a"])  # evicted again, plainly: the newer generation's cause wins
    assert (record.cause(b"a"), record.cause(b"b")) == ("evicted", "evicted_below_retained")
    record.cache_cleared()
    assert record.cause(b"a") is None
    roomy = EvictedHashes(capacity=10)
    evict(roomy, [b"a"], "expired")
    evict(roomy, [b"a"])  # within one generation too, the later plain eviction hides the earlier cause
    assert roomy.cause(b"a") == "evicted"


def test_record_of_size_zero_keeps_nothing_and_a_negative_size_is_refused():
    record = EvictedHashes(capacity=0)
    evict(record, [b"a"])
    assert len(record) == 0
    with pytest.raises(ValueError, match="capacity"):
        KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, evicted_record_size=-1)


def test_reasons_follow_a_known_eviction_sequence():
    """new, then a hit, then evicted by a filler, then new again after a reset (a reset is not an eviction)."""
    mgr = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    prompt = unique_tokens(9, 0)  # two full blocks and one token
    assert run(mgr, prompt) == 0
    assert missed(mgr) == {"new": 8, "partial_block": 1}
    assert run(mgr, prompt) == 8
    assert missed(mgr) == {"new": 8, "partial_block": 2}
    run(mgr, unique_tokens(6 * BLOCK_SIZE - 1, 1000))  # needs every block: the prompt's two are evicted
    assert set(mgr.block_hashes(make_request(prompt))[:2]) <= set(mgr.evicted)
    assert run(mgr, prompt) == 0
    assert missed(mgr) == {"new": 8 + 20, "evicted": 8, "partial_block": 2 + 3 + 1}
    assert mgr.reset_prefix_cache()
    assert len(mgr.evicted) == 0
    run(mgr, prompt)
    assert missed(mgr) == {"new": 8 + 20 + 8, "evicted": 8, "partial_block": 2 + 3 + 1 + 1}
    assert_reasons_add_up(mgr)


def test_reasons_with_a_surviving_head_and_an_evicted_middle():
    mgr = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    head = unique_tokens(13, 0)  # blocks h0, h1, h2 (full) and one token
    run(mgr, head)
    # Freed tail first, so h2 is evicted before h1 and h0; the free blocks holding no hash go before all.
    run(mgr, unique_tokens(2 * BLOCK_SIZE + 1, 500))  # 3 blocks: the unused one, head's partial one, then h2
    assert mgr.block_hashes(make_request(head))[2] in mgr.evicted
    before = dict(mgr.stats.missed_tokens)
    assert run(mgr, head) == 8  # h0 and h1 hit; h2 was evicted
    delta = {r: mgr.stats.missed_tokens[r] - before[r] for r in MISS_REASONS}
    assert delta == {
        "new": 0,
        "evicted": 4,
        "expired": 0,
        "evicted_below_retained": 0,
        "partial_block": 1,
        "skipped": 0,
        "no_checkpoint": 0,
    }


def test_evictions_older_than_the_record_count_as_new():
    mgr = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, evicted_record_size=2)
    prompt = unique_tokens(5, 0)  # one full block
    run(mgr, prompt)
    for start in (1000, 2000, 3000):  # each filler evicts every block the one before cached
        run(mgr, unique_tokens(4 * BLOCK_SIZE, start))
    assert mgr.block_hashes(make_request(prompt))[0] not in mgr.evicted
    before = mgr.stats.missed_tokens["new"]
    run(mgr, prompt)
    assert mgr.stats.missed_tokens["new"] - before == 4


@pytest.mark.parametrize(
    ("num_tokens", "cached", "partial"),
    [
        (3, 0, 3),  # shorter than a block: every token is in the partial block
        (8, 4, 4),  # block-aligned and fully cached: the last block is computed for its last token
        (10, 8, 2),  # the tail that does not fill a block
    ],
)
def test_partial_block_is_what_no_cache_size_could_serve(num_tokens, cached, partial):
    mgr = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    run(mgr, unique_tokens(num_tokens, 0))
    before = dict(mgr.stats.missed_tokens)
    assert run(mgr, unique_tokens(num_tokens, 0)) == cached
    assert mgr.stats.missed_tokens["partial_block"] - before["partial_block"] == partial
    assert mgr.stats.missed_tokens["new"] == before["new"]
    assert_reasons_add_up(mgr)


def test_requests_that_do_not_read_the_cache_are_skipped():
    mgr = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    run(mgr, unique_tokens(9, 0))
    run(mgr, unique_tokens(9, 0), skip_reading_prefix_cache=True)
    assert mgr.stats.missed_tokens["skipped"] == 9
    off = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=False)
    run(off, unique_tokens(9, 0))
    assert missed(off) == {"skipped": 9}
    assert off.lookup(unique_tokens(9, 0)).first_miss_reason == "skipped"


def test_a_sub_block_copy_counts_as_reused_not_missed():
    mgr = KVCacheManager(num_blocks=16, block_size=16, sub_block_size=4)
    first = make_request(unique_tokens(27, 0))
    admit(mgr, first)
    mgr.index_written_sub_blocks()
    mgr.free(first)
    assert run(mgr, unique_tokens(26, 0) + [999, 998]) == 24  # 16 shared + 8 copied
    assert mgr.stats.copied_tokens == 8
    # Hittable tokens are the first 16 (28 tokens -> one whole block may hit); the rest are partial.
    assert missed(mgr) == {"new": 16, "partial_block": 11 + 4}
    assert_reasons_add_up(mgr)


def test_lookup_reports_the_cached_prefix_and_the_reason_for_the_rest():
    mgr = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    run(mgr, unique_tokens(9, 0))
    tokens = unique_tokens(8, 0) + unique_tokens(6, 100)
    found = mgr.lookup(tokens)
    assert found.prompt_tokens == 14
    assert (found.cached_tokens, found.cached_prefix_end, found.copied_tokens) == (8, 8, 0)
    assert found.missed_tokens == {
        "new": 4,
        "evicted": 0,
        "expired": 0,
        "evicted_below_retained": 0,
        "partial_block": 2,
        "skipped": 0,
        "no_checkpoint": 0,
    }
    assert found.first_miss_reason == "new"
    assert mgr.lookup(unique_tokens(9, 0), cache_salt="other").cached_tokens == 0
    assert mgr.lookup(unique_tokens(9, 0)).first_miss_reason == "partial_block"


def test_lookup_rejects_prompts_no_request_could_have():
    mgr = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="empty"):
        mgr.lookup([])
    with pytest.raises(ValueError, match="token ids"):
        mgr.lookup([-1, 2])


@pytest.mark.parametrize("policy", list(EVICTION_POLICIES))
def test_lookup_changes_no_state_and_not_the_eviction_order(policy):
    """Two managers take the same steps; one also looks prompts up. Both then evict the same blocks in order."""

    def build() -> KVCacheManager:
        mgr = KVCacheManager(
            num_blocks=12, block_size=BLOCK_SIZE, eviction_policy=policy, listeners=[EvictionRecorder()]
        )
        for start in (0, 100, 200):
            run(mgr, unique_tokens(9, start))
        run(mgr, unique_tokens(9, 0))  # a reused prefix (ARC keeps it on its second list)
        held = make_request(unique_tokens(9, 300))
        admit(mgr, held)  # one request still running, its blocks referenced
        return mgr

    looked_up, untouched = build(), build()
    before = manager_state(looked_up)
    for tokens in (unique_tokens(9, 100), unique_tokens(13, 0), unique_tokens(9, 300), unique_tokens(5, 900)):
        assert looked_up.lookup(tokens).cached_tokens == looked_up.find_prefix(make_request(tokens)).num_tokens
    assert manager_state(looked_up) == before

    def eviction_order(mgr: KVCacheManager) -> list:
        recorder = mgr.pool.listeners[-1]
        already = len(recorder.evicted)
        filler = make_request(unique_tokens(mgr.num_free_blocks * BLOCK_SIZE, 5000))
        assert mgr.allocate_slots(filler, filler.num_tokens) is not None
        return recorder.evicted[already:]

    assert eviction_order(looked_up) == eviction_order(untouched)
    assert len(eviction_order(build())) > 0


def test_the_pool_tells_why_each_block_left_expired_below_retained_or_plain():
    """The eviction order of test_retention's mixed pool, with each eviction's cause: expired blocks, then low and
    default ones while retained blocks stay free (lost to them), then the retained ones (plain pressure)."""
    clock = FakeClock()
    recorder = EvictionRecorder()
    mgr = KVCacheManager(
        num_blocks=12, block_size=BLOCK_SIZE, clock=clock, max_retention_ttl_s=1000.0, listeners=[recorder]
    )
    run(mgr, range(8), retention=[RetentionRange(0, priority=80, ttl_s=100)])  # blocks 0, 1
    run(mgr, range(100, 108))  # 2, 3: default
    run(mgr, range(200, 208), retention=[RetentionRange(0, priority=10)])  # 4, 5: low
    run(mgr, range(300, 308), retention=[RetentionRange(0, priority=80, ttl_s=10)])  # 6, 7
    clock.advance(11)  # 6 and 7 expire
    for start in (1000, 2000, 3000, 4000):  # held: 6, 2, 2 and 2 blocks taken, as in test_retention
        admit(mgr, make_request(unique_tokens(24 if start == 1000 else 8, start)))
    assert recorder.causes == ["expired"] * 2 + ["evicted_below_retained"] * 4 + ["evicted"] * 2
    assert [mgr.evicted.cause(h) for h in recorder.evicted] == recorder.causes


def test_a_block_whose_ttl_ended_misses_as_expired():
    clock = FakeClock()
    mgr = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE, clock=clock, max_retention_ttl_s=1000.0)
    prompt = unique_tokens(9, 0)  # two full blocks and one token
    run(mgr, prompt, retention=[RetentionRange(0, priority=80, ttl_s=10)])
    clock.advance(11)
    run(mgr, unique_tokens(6 * BLOCK_SIZE - 1, 1000))  # needs every block: the prompt's two leave expired
    found = mgr.lookup(prompt)
    assert (found.cached_tokens, found.first_miss_reason) == (0, "expired")
    assert found.missed_tokens == {
        "new": 0,
        "evicted": 0,
        "expired": 8,
        "evicted_below_retained": 0,
        "partial_block": 1,
        "skipped": 0,
        "no_checkpoint": 0,
    }
    before = dict(mgr.stats.missed_tokens)
    run(mgr, prompt)
    assert mgr.stats.missed_tokens["expired"] - before["expired"] == 8
    assert_reasons_add_up(mgr)


def test_a_plain_block_lost_to_free_retained_blocks_misses_as_evicted_below_retained():
    mgr = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, clock=FakeClock(), max_retention_ttl_s=1000.0)
    kept, plain = unique_tokens(9, 0), unique_tokens(9, 100)
    run(mgr, kept, retention=[RetentionRange(0, priority=80)])  # two retained blocks, free
    run(mgr, plain)  # two default blocks
    run(mgr, unique_tokens(6 * BLOCK_SIZE - 1, 1000))  # 4 never-cached blocks, then plain's two; kept's stay
    assert mgr.lookup(kept).cached_tokens == 8
    found = mgr.lookup(plain)
    assert (found.cached_tokens, found.first_miss_reason) == (0, "evicted_below_retained")
    assert found.missed_tokens["evicted_below_retained"] == 8
    assert_reasons_add_up(mgr)


def test_retained_blocks_in_use_do_not_make_an_eviction_below_them():
    """A retained block a request holds could not have been evicted instead: the plain block's loss is pressure."""
    mgr = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, clock=FakeClock(), max_retention_ttl_s=1000.0)
    held = make_request(unique_tokens(9, 0), retention=[RetentionRange(0, priority=80)])
    admit(mgr, held)  # three blocks in use, two of them retained
    plain = unique_tokens(9, 100)
    run(mgr, plain)
    run(mgr, unique_tokens(5 * BLOCK_SIZE - 1, 1000))  # the 3 never-cached free blocks, then plain's two
    assert mgr.lookup(plain).first_miss_reason == "evicted"
