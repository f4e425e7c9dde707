"""Sub-block prefix matching in the manager: exact hits, copies, indexing only after K/V is written."""

import random

import pytest

from prefixcache.core import KVCacheManager
from prefixcache.core.sub_block import CopyOp
from tests.core.conftest import admit, make_request, unique_tokens

BLOCK, SUB = 16, 4


def make_manager(**kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks=kwargs.pop("num_blocks", 16), block_size=BLOCK, sub_block_size=SUB, **kwargs)


def run_written(mgr: KVCacheManager, request) -> int:
    """Admit the whole prompt and mark its K/V written, as the engine does after a forward pass."""
    num_cached = admit(mgr, request)
    mgr.index_written_sub_blocks()
    return num_cached


def test_partial_block_prefix_is_reused_by_copy():
    mgr = make_manager()
    a = make_request(unique_tokens(27, 0))  # block 0 full, block 1 holds 11 tokens
    run_written(mgr, a)
    assert mgr.take_transfers()[0] == []
    b = make_request(unique_tokens(27, 0)[:26] + [999, 998])
    hit = mgr.find_prefix(b)
    num_cached = hit.num_tokens
    assert num_cached == 24  # block 0 shared, then 8 of block 1's 10 matching tokens (2 sub-blocks)
    assert hit.block_ids() == [[0, 1]]
    new = mgr.allocate_slots(b, b.num_tokens - num_cached, hit)
    assert [blk.block_id for blk in new] == [2]
    assert mgr.block_ids(b) == [[0, 2]]
    assert mgr.take_transfers()[0] == [CopyOp(src=1, dst=2, num_tokens=8)]
    assert mgr.take_transfers()[0] == []
    assert mgr.pool.blocks[1].ref_cnt == 1  # the source is only read, never referenced by b
    assert (mgr.stats.hits, mgr.stats.copied_tokens) == (16 + 8, 8)
    assert mgr.stats.hit_rate == pytest.approx((16 + 8) / (27 + 28))
    mgr.check_invariants()


def test_sub_prefix_is_findable_only_after_its_kv_is_written():
    mgr = make_manager()
    a = make_request(unique_tokens(10, 0))
    admit(mgr, a)
    probe = make_request(unique_tokens(10, 0) + [7])
    assert mgr.find_prefix(probe).num_tokens == 0
    mgr.index_written_sub_blocks()
    assert mgr.find_prefix(probe).num_tokens == 8


def test_full_hit_cap_holds_at_sub_block_granularity():
    mgr = make_manager()
    run_written(mgr, make_request(unique_tokens(13, 0)))
    assert mgr.find_prefix(make_request(unique_tokens(13, 0))).num_tokens == 12 - 12 % SUB  # 12: leaves token 13
    assert mgr.find_prefix(make_request(unique_tokens(12, 0))).num_tokens == 8  # 11 tokens allowed -> 2 sub-blocks


def test_decoded_tokens_are_indexed_as_they_are_written():
    mgr = make_manager()
    a = make_request(unique_tokens(6, 0))
    run_written(mgr, a)
    for token in (50, 51, 52):
        a.append_output_token_ids([token])
        mgr.allocate_slots(a, 1)
        mgr.index_written_sub_blocks()
    follow_up = make_request([*unique_tokens(6, 0), 50, 51, 52, 60])
    assert mgr.find_prefix(follow_up).num_tokens == 8


def test_reused_source_is_forgotten_and_a_stale_lookup_is_rejected():
    mgr = make_manager(num_blocks=3)
    a = make_request(unique_tokens(10, 0))
    run_written(mgr, a)
    mgr.free(a)
    b = make_request(unique_tokens(10, 0) + [5])
    hit = mgr.find_prefix(b)
    num_cached = hit.num_tokens
    assert num_cached == 8
    admit(mgr, make_request(unique_tokens(40, 100)))  # takes every block, overwriting the source
    mgr.check_invariants()
    with pytest.raises(ValueError, match="look it up again"):
        mgr.allocate_slots(b, b.num_tokens - num_cached, hit)
    assert mgr.find_prefix(b).num_tokens == 0


def test_salt_and_lora_apply_to_sub_blocks():
    mgr = make_manager()
    run_written(mgr, make_request(unique_tokens(10, 0), cache_salt="t1"))
    assert mgr.find_prefix(make_request(unique_tokens(11, 0), cache_salt="t2")).num_tokens == 0
    assert mgr.find_prefix(make_request(unique_tokens(11, 0))).num_tokens == 0
    assert mgr.find_prefix(make_request(unique_tokens(11, 0), cache_salt="t1")).num_tokens == 8


def test_sub_block_size_equal_to_block_size_is_plain_block_matching():
    rng = random.Random(1)
    prefixes = [[rng.randrange(50) for _ in range(n)] for n in (20, 35, 9)]
    plain = KVCacheManager(num_blocks=12, block_size=BLOCK)
    same = KVCacheManager(num_blocks=12, block_size=BLOCK, sub_block_size=BLOCK)
    assert same.sub_blocks is None
    live = {id(m): [] for m in (plain, same)}
    for step in range(60):
        tokens = prefixes[step % 3] + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        results = []
        for mgr in (plain, same):
            req = make_request(tokens, request_id=f"r{step}")
            hit = mgr.find_prefix(req)
            num_cached = hit.num_tokens
            new = mgr.allocate_slots(req, req.num_tokens - num_cached, hit)
            results.append((num_cached, hit.block_ids(), new and [b.block_id for b in new]))
            if new is not None:
                live[id(mgr)].append(req)
            if len(live[id(mgr)]) > 3:
                mgr.free(live[id(mgr)].pop(0))
        assert results[0] == results[1]


def test_bad_sub_block_size_is_a_clear_error():
    with pytest.raises(ValueError, match="divisor"):
        KVCacheManager(num_blocks=4, block_size=16, sub_block_size=5)
    with pytest.raises(ValueError, match="divisor"):
        KVCacheManager(num_blocks=4, block_size=16, sub_block_size=0)
