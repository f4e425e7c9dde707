"""``HeldCache``'s chunked prefill: one step a chunk, as the scheduler runs a request alone, so a recurrent
model's finish checkpoint moves with each step's end; a request that cannot fit is given back whole."""

import pytest

from prefixcache.core import FULL_ATTENTION, KVCacheManager, Request
from prefixcache.core.kv_cache_groups import RECURRENT_STATE
from prefixcache.replay import HeldCache


def hybrid_manager(num_blocks: int = 32) -> KVCacheManager:
    return KVCacheManager(
        num_blocks=num_blocks,
        block_size=16,
        groups=(FULL_ATTENTION, RECURRENT_STATE),
        num_state_slots=1,
        num_checkpoint_slots=4,
    )


@pytest.mark.parametrize(("chunk", "finish_saves"), [(None, [6]), (40, [2, 5, 6])])
def test_each_chunk_is_a_step_that_moves_the_finish_checkpoint(chunk, finish_saves):
    """100 tokens in chunks of 40 end steps at 40, 80 and 100 tokens: finish checkpoints at 2, 5 and 6 blocks,
    each earlier one given up for the next (nobody hit it); in one step, one checkpoint at 6 blocks."""
    manager = hybrid_manager()
    cache = HeldCache(manager, in_flight=1, max_chunk_tokens=chunk)
    request = Request("a", list(range(100)))
    assert cache.admit(0, request, 0) == 0
    assert request.num_computed_tokens == 100
    state = manager.state
    assert state.stats.saved["finish"] == len(finish_saves)
    assert [c.num_blocks for c in state.checkpoints.values()] == [6]
    cache.drain()
    manager.check_invariants()
    follower = Request("b", list(range(100)) + [7])
    assert cache.admit(1, follower, 0) == 96  # the prompt's last full block


def test_a_request_larger_than_the_cache_is_given_back_whole():
    manager = hybrid_manager(num_blocks=4)
    cache = HeldCache(manager, in_flight=1, max_chunk_tokens=16)
    with pytest.raises(ValueError, match="more than the capacity of 4"):
        cache.admit(0, Request("big", list(range(100))), 0)
    assert manager.num_free_blocks == 4 and manager.state.has_working_slot
    manager.check_invariants()


def test_a_chunk_must_be_positive():
    with pytest.raises(ValueError, match="max_chunk_tokens must be positive"):
        HeldCache(hybrid_manager(), max_chunk_tokens=0)
