"""Eviction policies: exact eviction order on small cases, and what each policy buys through the manager."""

import pytest

from prefixcache.core import EVICTION_POLICIES, KVCacheManager
from prefixcache.core.block_pool import Block
from prefixcache.core.eviction import AdaptiveEvictionPolicy, LRUEvictionPolicy, make_eviction_policy
from tests.core.conftest import BLOCK_SIZE, admit, make_request, unique_tokens


def cached_blocks(n: int, start: int = 0) -> list[Block]:
    return [Block(block_id=i, block_hash=f"h{i}".encode()) for i in range(start, start + n)]


def drain(policy) -> list[int]:
    out = []
    while len(policy):
        out.append(policy.pop().block_id)
    return out


def test_registry_names_and_factory():
    assert list(EVICTION_POLICIES)[:2] == ["lru", "arc"]
    assert isinstance(make_eviction_policy("lru"), LRUEvictionPolicy)
    assert isinstance(make_eviction_policy("arc"), AdaptiveEvictionPolicy)
    oracle = AdaptiveEvictionPolicy()
    assert make_eviction_policy(oracle) is oracle
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'; choose one of lru, arc"):
        make_eviction_policy("mru")


@pytest.mark.parametrize("name", list(EVICTION_POLICIES))
def test_every_policy_pops_what_it_holds_and_forgets_on_clear(name):
    policy = make_eviction_policy(name)
    blocks = cached_blocks(5)
    for block in blocks:
        policy.push(block)
    policy.remove(blocks[2])
    assert len(policy) == 4
    assert sorted(b.block_id for b in policy) == [0, 1, 3, 4]
    assert sorted(drain(policy)) == [0, 1, 3, 4]
    for block in blocks:
        policy.push(block)
    policy.clear()
    assert len(policy) == 0
    assert list(policy) == []


def test_lru_evicts_in_free_order_and_a_hit_block_goes_to_the_back():
    policy = LRUEvictionPolicy()
    a, b, c = cached_blocks(3)
    for block in (a, b, c):
        policy.push(block)
    policy.remove(a)  # hit while free
    policy.push(a)  # freed again: now the most recent
    assert [blk.block_id for blk in policy] == [1, 2, 0]
    assert drain(policy) == [1, 2, 0]


def test_arc_evicts_prefixes_freed_once_before_prefixes_freed_again():
    policy = AdaptiveEvictionPolicy()
    blocks = cached_blocks(4)
    for block in blocks:
        policy.push(block)
    policy.remove(blocks[1])
    policy.push(blocks[1])  # freed twice: reused
    policy.remove(blocks[0])
    policy.push(blocks[0])  # reused, behind block 1
    assert [b.block_id for b in policy] == [2, 3, 1, 0]
    assert drain(policy) == [2, 3, 1, 0]


def test_arc_a_prefix_evicted_from_the_once_list_and_filled_again_lengthens_that_list():
    policy = AdaptiveEvictionPolicy()
    a, b = cached_blocks(2)
    policy.push(a)
    policy.push(b)
    assert policy.pop() is a  # its hash goes to the once ghost list
    policy.push(Block(block_id=7, block_hash=a.block_hash))  # a miss on a: now reused, and the once list may hold 1
    policy.push(Block(block_id=8, block_hash=b"fresh"))
    assert drain(policy) == [1, 7, 8]


def test_arc_a_reused_prefix_evicted_and_filled_again_shortens_the_once_list():
    policy = AdaptiveEvictionPolicy()
    a, b = cached_blocks(2)
    policy.push(a)
    policy.push(b)
    policy.pop()  # a, to the once ghost list
    policy.push(Block(block_id=7, block_hash=a.block_hash))  # target 1
    assert policy.pop().block_id == 7  # the once list holds no more than its target: the reused block goes
    policy.push(Block(block_id=9, block_hash=a.block_hash))  # a reused-ghost hit: target back to 0
    policy.push(Block(block_id=10, block_hash=b"fresh"))
    assert drain(policy) == [1, 10, 9]


def test_arc_ghost_lists_are_bounded_by_the_largest_free_queue():
    policy = AdaptiveEvictionPolicy()
    first = cached_blocks(1)[0]
    policy.push(first)
    assert policy.pop() is first
    # The free queue never held more than one block, so the ghost list keeps GHOST_FACTOR hashes.
    for block in cached_blocks(AdaptiveEvictionPolicy.GHOST_FACTOR, start=1):
        policy.push(block)
        policy.pop()
    policy.push(Block(block_id=9, block_hash=first.block_hash))
    policy.push(Block(block_id=10, block_hash=b"ten"))
    policy.push(Block(block_id=11, block_hash=b"eleven"))
    assert drain(policy) == [9, 10, 11]  # first's history was forgotten (else: [10, 9, 11])


def test_arc_clear_forgets_history_and_target():
    policy = AdaptiveEvictionPolicy()
    a, b = cached_blocks(2)
    policy.push(a)
    policy.push(b)
    policy.pop()
    policy.push(Block(block_id=7, block_hash=a.block_hash))  # target 1
    policy.clear()
    for block in (Block(block_id=7, block_hash=a.block_hash), *cached_blocks(2, start=1)):
        policy.push(block)
    assert drain(policy) == [7, 1, 2]


def reused_prefix_after_one_off_prompts(policy: str) -> int:
    """A prefix used twice, then one-off prompts that need two evictions; how much of it survives."""
    mgr = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE, eviction_policy=policy)
    prefix = unique_tokens(2 * BLOCK_SIZE, 100)
    for tail in (1, 2):
        req = make_request([*prefix, tail])
        admit(mgr, req)
        mgr.free(req)
    one_off = make_request(unique_tokens(2 * BLOCK_SIZE + 1, 500))
    admit(mgr, one_off)
    mgr.free(one_off)
    admit(mgr, make_request(unique_tokens(3 * BLOCK_SIZE + 1, 900)))  # two uncached blocks, two evictions
    mgr.check_invariants()
    return mgr.find_prefix(make_request([*prefix, 3])).num_tokens


def test_through_the_manager_arc_keeps_a_reused_prefix_that_lru_evicts():
    assert reused_prefix_after_one_off_prompts("lru") == 0
    assert reused_prefix_after_one_off_prompts("arc") == 2 * BLOCK_SIZE
