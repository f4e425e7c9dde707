"""KV cache groups without torch: the longest hit every group agrees on, and a manager whose sliding-window
group gives back the blocks that left its window. Blocks of 4 tokens; the sliding group's window of 8 tokens
lets a query see the 7 before it, so a hit needs the 2 blocks before its end there (cdiv(7, 4))."""

import pytest

from prefixcache.core import FULL_ATTENTION, KVCacheGroupSpec, KVCacheManager, longest_common_hit
from prefixcache.core.eviction import LRUEvictionPolicy
from prefixcache.core.kv_cache_groups import window_hit
from tests.core.conftest import BLOCK_SIZE, admit, make_request, manager_state, unique_tokens

SLIDING = KVCacheGroupSpec(sliding_window=8)
HYBRID = (FULL_ATTENTION, SLIDING)
HASHES = [f"h{i}".encode() for i in range(8)]


def holding(*indexes: int):
    """A group's lookup that holds the blocks of these indexes (the value found is the index)."""
    held = {HASHES[i]: i for i in indexes}
    return held.get


class ChosenFirst(LRUEvictionPolicy):
    """LRU, except that the blocks named in ``first`` are evicted before all others (to pin a scenario)."""

    def __init__(self) -> None:
        super().__init__()
        self.first: list = []

    def pop(self):
        while self.first:
            block = self.first.pop(0)
            if block.block_id in self._queue:
                self.remove(block)
                return block
        return super().pop()


def hybrid_manager(num_blocks: int = 24, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, groups=HYBRID, **kwargs)


# ---- the rule, on plain lookups ----------------------------------------------------------------------


def test_spec_reports_its_window_in_blocks_and_the_first_block_a_query_reads():
    assert (FULL_ATTENTION.kind, SLIDING.kind) == ("full_attention", "sliding_window")
    assert FULL_ATTENTION.window_blocks(BLOCK_SIZE) is None
    assert [KVCacheGroupSpec(w).window_blocks(4) for w in (1, 2, 5, 8, 9)] == [0, 1, 1, 2, 2]
    # The query at 16 reads 9..16: block 2 (8..11) is the first it needs, 0 and 1 left the window.
    assert [SLIDING.first_needed_block(n, BLOCK_SIZE) for n in (0, 7, 10, 11, 16, 20)] == [0, 0, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheGroupSpec(0)


def test_a_sliding_group_needs_only_the_window_before_the_hit_point_holes_before_it_allowed():
    assert window_hit(holding(3, 4), HASHES, 6, 2) == (5, [3, 4])  # 5 missing: the hit ends at 5
    assert window_hit(holding(0, 1, 2, 3, 4, 5), HASHES, 6, 2) == (6, [4, 5])
    assert window_hit(holding(0, 2, 3), HASHES, 6, 2) == (4, [2, 3])  # the hole at 1 does not matter
    assert window_hit(holding(0, 1, 3), HASHES, 6, 2) == (2, [0, 1])  # 1..2 and 2..3 have holes
    assert window_hit(holding(0, 3), HASHES, 6, 2) == (1, [0])  # shorter than the window: all from block 0
    assert window_hit(holding(1, 2), HASHES, 6, 2) == (3, [1, 2])
    assert window_hit(holding(), HASHES, 6, 0) == (6, [])  # a window of 1 token needs nothing cached


def test_groups_are_asked_again_until_none_lowers_the_hit():
    wide = KVCacheGroupSpec(sliding_window=8)  # 2 blocks before the end
    narrow = KVCacheGroupSpec(sliding_window=5)  # 1 block
    groups = (FULL_ATTENTION, wide, narrow)
    lookups = [holding(*range(8)), holding(0, 1, 2, 3, 5), holding(0, 1, 2, 5)]
    # full: 6; wide: 4 (blocks 2, 3; 4 is missing); narrow at 4: 3 is missing, so 3; wide at 3: blocks 1, 2.
    assert longest_common_hit(groups, lookups, HASHES, 6, BLOCK_SIZE) == (3, [[0, 1, 2], [1, 2], [2]])


def test_the_full_group_bounds_the_hit_from_the_first_block():
    lookups = [holding(0, 1, 3, 4, 5), holding(*range(8))]
    assert longest_common_hit(HYBRID, lookups, HASHES, 6, BLOCK_SIZE) == (2, [[0, 1], [0, 1]])
    assert longest_common_hit(HYBRID, [holding(1, 2), holding(1, 2)], HASHES, 6, BLOCK_SIZE) == (0, [[], []])


# ---- the manager with a sliding group -----------------------------------------------------------------


def test_block_0_is_the_null_block_and_each_group_gets_its_own_blocks():
    mgr = hybrid_manager()
    assert mgr.null_block is mgr.pool.blocks[0] and mgr.num_usable_blocks == 23
    request = make_request(unique_tokens(10, 0))
    assert admit(mgr, request) == 0
    assert mgr.block_ids(request) == [[1, 2, 3], [4, 5, 6]]
    assert mgr.num_free_blocks == 17 and mgr.usage == pytest.approx(6 / 23)
    mgr.check_invariants()


def test_a_sliding_group_gives_back_blocks_that_left_its_window_at_each_chunk_and_decode_step():
    mgr = hybrid_manager()
    request = make_request(unique_tokens(20, 0))
    mgr.allocate_slots(request, 8)  # tokens 0..7
    assert mgr.block_ids(request) == [[1, 2], [3, 4]]
    mgr.allocate_slots(request, 8)  # tokens 8..15: their queries read from token 1 on, so block 0 still
    assert mgr.block_ids(request) == [[1, 2, 5, 6], [3, 4, 7, 8]]
    mgr.allocate_slots(request, 4)  # tokens 16..19 read from 9 on: blocks 0 and 1 (tokens 0..7) leave
    assert mgr.block_ids(request) == [[1, 2, 5, 6, 9], [0, 0, 7, 8, 10]]
    # Given back last first to the cached free queue, hashes kept: findable until evicted.
    hashes = mgr.block_hashes(request)
    assert [(b.block_id, b.block_hash, b.group) for b in mgr.pool.evictable] == [(4, hashes[1], 1), (3, hashes[0], 1)]
    request.append_output_token_ids([7])
    mgr.allocate_slots(request, 1)  # decode at 20 reads 13..20: block 2 (8..11) leaves
    assert mgr.block_ids(request) == [[1, 2, 5, 6, 9, 11], [0, 0, 0, 8, 10, 12]]
    for token in (8, 9):
        request.append_output_token_ids([token])
        mgr.allocate_slots(request, 1)  # decodes at 21 and 22 still read block 3 (12..15)
    assert mgr.block_ids(request)[1] == [0, 0, 0, 8, 10, 12]
    request.append_output_token_ids([10])
    mgr.allocate_slots(request, 1)  # decode at 23 reads 16..23: block 3 leaves
    assert mgr.block_ids(request)[1] == [0, 0, 0, 0, 10, 12]
    request.append_output_token_ids([11])
    mgr.allocate_slots(request, 1)  # decode at 24 starts block 6 in each group
    assert mgr.block_ids(request) == [[1, 2, 5, 6, 9, 11, 13], [0, 0, 0, 0, 10, 12, 14]]
    assert [b.block_id for b in mgr.pool.evictable] == [4, 3, 7, 8]
    mgr.check_invariants()
    mgr.free(request)  # position by position, last first, across groups (the null block is skipped)
    assert [b.block_id for b in mgr.pool.evictable] == [4, 3, 7, 8, 11, 12, 9, 10, 6, 5, 2, 1]
    assert [b.block_id for b in mgr.pool.uncached_free][-2:] == [13, 14]  # the partial last blocks
    mgr.check_invariants()


@pytest.mark.parametrize("shared_blocks", range(6))
def test_a_prompt_sharing_exactly_k_blocks_hits_k_blocks_in_every_group(shared_blocks):
    mgr = hybrid_manager(num_blocks=40)
    first = make_request(unique_tokens(6 * BLOCK_SIZE + 1, 0))
    admit(mgr, first)
    full, sliding = mgr.block_ids(first)
    mgr.free(first)
    tokens = unique_tokens(shared_blocks * BLOCK_SIZE, 0) + unique_tokens(3 * BLOCK_SIZE, 500)
    hit = mgr.find_prefix(make_request(tokens))
    k = shared_blocks
    assert hit.num_tokens == k * BLOCK_SIZE
    assert hit.block_ids() == [full[:k], [0] * max(0, k - 2) + sliding[max(0, k - 2) : k]]


def evicting(blocks: list[int]) -> tuple[KVCacheManager, list[int]]:
    """A prompt of 6 full blocks (and a token) computed and freed, then a filler that takes every never-used
    block and evicts exactly ``blocks``; returns the manager and a prompt sharing the 6 blocks."""
    policy = ChosenFirst()
    mgr = hybrid_manager(num_blocks=26, eviction_policy=policy)
    first = make_request(unique_tokens(6 * BLOCK_SIZE + 1, 0))
    admit(mgr, first)
    assert mgr.block_ids(first) == [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
    mgr.free(first)  # 13 blocks never held a prefix (15..25, and the partial 7 and 14)
    policy.first = [mgr.pool.blocks[i] for i in blocks]
    filler = make_request(unique_tokens(8 * BLOCK_SIZE, 5000))
    assert mgr.allocate_slots(filler, filler.num_tokens) is not None  # 16 blocks: the 13, then 3 evicted
    assert all(mgr.pool.blocks[i].ref_cnt == 1 for i in blocks)  # the filler holds them now
    mgr.check_invariants()
    return mgr, unique_tokens(6 * BLOCK_SIZE, 0) + [999]


def test_a_hit_survives_the_sliding_group_losing_the_blocks_before_its_window():
    mgr, probe = evicting([8, 9, 10])  # the sliding group's blocks 0..2
    hit = mgr.find_prefix(make_request(probe))
    assert hit.num_tokens == 6 * BLOCK_SIZE  # the window before block 6 is blocks 4 and 5: still there
    assert hit.block_ids() == [[1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 12, 13]]


def test_the_full_group_losing_an_early_block_cuts_the_hit_there():
    mgr, probe = evicting([2, 10, 11])  # the full group's block 1; the sliding group's blocks 2 and 3
    hit = mgr.find_prefix(make_request(probe))
    assert hit.num_tokens == BLOCK_SIZE  # every block from the first is needed in the full group
    assert hit.block_ids() == [[1], [8]]


def test_the_sliding_group_losing_its_window_lowers_the_hit_to_a_window_it_holds():
    mgr, probe = evicting([13, 10, 3])  # sliding blocks 5 and 2, and the full group's block 2 as the third
    hit = mgr.find_prefix(make_request(probe))
    assert hit.num_tokens == 2 * BLOCK_SIZE  # the full group stops at 2; its window (blocks 0, 1) is there
    assert hit.block_ids() == [[1, 2], [8, 9]]


def test_admission_with_a_hit_takes_only_the_window_and_computes_the_rest():
    mgr = hybrid_manager(num_blocks=40)
    first = make_request(unique_tokens(6 * BLOCK_SIZE + 1, 0))
    admit(mgr, first)
    mgr.free(first)
    second = make_request(unique_tokens(6 * BLOCK_SIZE, 0) + unique_tokens(5, 900))
    assert admit(mgr, second) == 6 * BLOCK_SIZE
    full, sliding = mgr.block_ids(second)
    assert full[:6] == [1, 2, 3, 4, 5, 6] and sliding[:6] == [0, 0, 0, 0, 12, 13]
    assert [mgr.pool.blocks[i].ref_cnt for i in (1, 6, 8, 12, 13)] == [1, 1, 0, 1, 1]  # 8: sliding block 0, free
    stats = mgr.stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 25 + 29, 24)
    mgr.check_invariants()


def test_blocks_leaving_the_window_make_room_but_only_when_the_allocation_succeeds():
    mgr = hybrid_manager(num_blocks=12)  # 11 usable
    request = make_request(unique_tokens(24, 0))
    mgr.allocate_slots(request, 12)  # 3 + 3 blocks, 5 free
    other = make_request(unique_tokens(1, 300))
    assert mgr.allocate_slots(other, 1) is not None  # 1 + 1: 3 free
    before = manager_state(mgr)
    assert mgr.allocate_slots(request, 12) is None  # 3 + 3 needed; 3 free and 1 leaving the window (block 0)
    assert manager_state(mgr) == before and request.num_computed_tokens == 12
    assert mgr.allocate_slots(request, 8) is not None  # 2 + 2 needed: fits only with the block that leaves
    assert mgr.block_ids(request) == [[1, 2, 3, 9, 10], [0, 5, 6, 11, 4]]
    assert mgr.num_free_blocks == 0
    mgr.check_invariants()


def test_peak_blocks_bounds_what_a_request_holds_at_any_step():
    for prompt, chunk in [(40, 8), (41, 7), (9, 16), (33, 5), (64, 64)]:
        mgr = hybrid_manager(num_blocks=200)
        request = make_request(unique_tokens(prompt, 0))
        peak = 0
        while request.num_computed_tokens < request.num_tokens:
            mgr.allocate_slots(request, min(chunk, request.num_tokens - request.num_computed_tokens))
            peak = max(peak, mgr.num_usable_blocks - mgr.num_free_blocks)
        for token in range(12):
            request.append_output_token_ids([token])
            mgr.allocate_slots(request, 1)
            peak = max(peak, mgr.num_usable_blocks - mgr.num_free_blocks)
        assert peak <= mgr.peak_blocks(prompt + 12, chunk), (prompt, chunk)
    mgr = hybrid_manager(num_blocks=11)
    longest = mgr.max_request_tokens(max_chunk_tokens=8)
    assert mgr.peak_blocks(longest, 8) <= 10 < mgr.peak_blocks(longest + 1, 8)


def test_reset_drops_every_group_and_keeps_the_null_block_out():
    mgr = hybrid_manager()
    request = make_request(unique_tokens(13, 0))
    admit(mgr, request)
    assert mgr.reset_prefix_cache() is False
    mgr.free(request)
    assert mgr.reset_prefix_cache() is True
    assert all(not cached for cached in mgr.pool.cached)
    assert mgr.find_prefix(make_request(unique_tokens(13, 0))).num_tokens == 0
    again = make_request(unique_tokens(13, 0))
    admit(mgr, again)
    assert mgr.block_ids(again) == [[1, 2, 3, 4], [5, 6, 7, 8]]
    mgr.check_invariants()


def test_sub_blocks_are_refused_for_more_than_one_group():
    with pytest.raises(ValueError, match="sub-block prefix matching supports one full-attention"):
        hybrid_manager(sub_block_size=2)
    with pytest.raises(ValueError, match="sub-block"):
        KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, groups=[SLIDING], sub_block_size=2)
