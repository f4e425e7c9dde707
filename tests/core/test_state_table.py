"""The recurrent-state group and its checkpoint policy, without torch: which request leaves which checkpoint in
which slot, what a later request hits, what the budget evicts first. Blocks of 4 tokens; state slots 0 and 1
are the working states, the checkpoint slots follow. Each step is followed by ``take_transfers``, as in the
engine (a checkpoint is findable once the forward pass that saves it ran)."""

import pytest

from prefixcache.core import FULL_ATTENTION, KVCacheGroupSpec, KVCacheManager, longest_common_hit
from prefixcache.core.kv_cache_groups import RECURRENT_STATE, check_groups, spec_of_kind
from prefixcache.core.state_table import (
    ALIGNED_POLICY,
    DEFAULT_CHECKPOINT_POLICY,
    CheckpointPolicy,
    StateWork,
    sparse_interval,
)
from tests.core.conftest import BLOCK_SIZE, make_request, manager_state
from tests.core.test_kv_cache_groups import HASHES, holding

STATE_GROUPS = (FULL_ATTENTION, RECURRENT_STATE)


def state_manager(num_checkpoint_slots=3, policy=DEFAULT_CHECKPOINT_POLICY, num_blocks=40, **kwargs) -> KVCacheManager:
    return KVCacheManager(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        groups=kwargs.pop("groups", STATE_GROUPS),
        num_state_slots=2,
        num_checkpoint_slots=num_checkpoint_slots,
        checkpoint_policy=policy,
        **kwargs,
    )


def step(mgr, req, num_new, hit=None) -> StateWork:
    assert mgr.allocate_slots(req, num_new, hit) is not None, "did not fit"
    work = mgr.state_work(req)
    mgr.take_transfers()
    return work


def serve(mgr, req, chunk=64, outputs=()):
    """Look up, prefill in chunks, decode ``outputs`` one a step, free: (the hit, each step's state work)."""
    hit = mgr.find_prefix(req)
    works = [step(mgr, req, min(chunk, req.num_tokens - hit.num_tokens), hit)]
    while req.num_computed_tokens < req.num_tokens:
        works.append(step(mgr, req, min(chunk, req.num_tokens - req.num_computed_tokens)))
    for token in outputs:
        req.append_output_token_ids([token])
        works.append(step(mgr, req, 1))
    mgr.free(req)
    mgr.check_invariants()
    return hit, works


def checkpoints(mgr) -> list[tuple[int, str, int]]:
    """(boundary in blocks, rule, slot) of every checkpoint, by slot."""
    return sorted(((c.num_blocks, c.rule, c.slot) for c in mgr.state.checkpoints.values()), key=lambda c: c[2])


def test_finish_checkpoint_follows_decode_and_the_next_turn_hits_it():
    mgr = state_manager()
    a = make_request(range(10))
    _, works = serve(mgr, a, outputs=[50, 51])
    # The prefill leaves its frontier after block 2; the decode step that fills block 3 moves it there (same slot).
    assert works == [StateWork(0, zero=True, saves=[(8, 2)]), StateWork(0), StateWork(0, saves=[(1, 2)])]
    assert checkpoints(mgr) == [(3, "finish", 2)]
    b = make_request([*range(10), 50, 51, 60, 61, 62])
    hit, works = serve(mgr, b)
    assert hit.num_tokens == 12 and hit.checkpoint.slot == 2
    assert works[0] == StateWork(1, restore_from=2)
    assert mgr.stats.hits == 12 and mgr.state.stats.hits["finish"] == 1


def test_junction_second_request_leaves_one_third_hits_it_exactly():
    mgr = state_manager()
    serve(mgr, make_request(range(100, 116)))
    assert checkpoints(mgr) == [(4, "finish", 2)]
    # B shares 2 blocks of A's path, where A has no checkpoint: it starts from zero and leaves one at 2.
    found = mgr.lookup([*range(100, 108), 1, 2, 3, 4, 5])
    assert (found.cached_tokens, found.no_checkpoint_tokens, found.first_miss_reason) == (0, 8, "no_checkpoint")
    assert found.missed_tokens == {
        "new": 4,
        "evicted": 0,
        "expired": 0,
        "evicted_below_retained": 0,
        "partial_block": 1,
        "skipped": 0,
        "no_checkpoint": 8,
    }
    hit, works = serve(mgr, make_request([*range(100, 108), 1, 2, 3, 4, 5]))
    assert (hit.num_tokens, hit.checkpoint, hit.junction_blocks) == (0, None, 2)
    assert mgr.stats.missed_tokens["no_checkpoint"] == 8  # admission counts what the lookup said
    assert works[0] == StateWork(1, zero=True, saves=[(8, 3), (12, 4)])
    assert checkpoints(mgr) == [(4, "finish", 2), (2, "junction", 3), (3, "finish", 4)]
    # C parts there too: it hits both blocks, and its own frontier evicts A's, the oldest never hit.
    assert mgr.lookup([*range(100, 108), 9, 9, 9, 9, 9]).no_checkpoint_tokens == 0
    hit, works = serve(mgr, make_request([*range(100, 108), 9, 9, 9, 9, 9]))
    assert (hit.num_tokens, hit.checkpoint.slot, hit.junction_blocks) == (8, 3, 0)
    assert works[0] == StateWork(0, restore_from=3, saves=[(4, 2)])
    assert checkpoints(mgr) == [(3, "finish", 2), (2, "junction", 3), (3, "finish", 4)]
    assert mgr.state.stats.evicted["finish"] == 1 and mgr.state.stats.hits["junction"] == 1


def test_sparse_checkpoints_let_the_second_request_resume_close_to_where_it_parts():
    mgr = state_manager(num_checkpoint_slots=4, policy=CheckpointPolicy(sparse_every_blocks=2))
    _, works = serve(mgr, make_request(range(100, 120)), chunk=8)
    assert [w.saves for w in works] == [[(8, 2)], [(8, 3)], [(4, 4)]]
    assert checkpoints(mgr) == [(2, "sparse", 2), (4, "sparse", 3), (5, "finish", 4)]
    # B parts inside block 3: it resumes from the sparse checkpoint at 2 and leaves a junction at 3. Its own
    # sparse checkpoint and frontier need room: A's never-hit sparse one goes first, then A's frontier.
    hit, works = serve(mgr, make_request([*range(100, 114), 1, 1, 1, 1, 1, 1]), chunk=16)
    assert (hit.num_tokens, hit.checkpoint.slot, hit.junction_blocks) == (8, 2, 3)
    assert works[0] == StateWork(1, restore_from=2, saves=[(4, 5), (8, 3), (12, 4)])
    assert checkpoints(mgr) == [(2, "sparse", 2), (4, "sparse", 3), (5, "finish", 4), (3, "junction", 5)]
    assert mgr.state.stats.evicted == {"finish": 1, "junction": 0, "sparse": 1, "hint": 0, "step_end": 0}


def test_hint_checkpoint_at_a_message_boundary():
    mgr = state_manager()
    _, works = serve(mgr, make_request(range(20), checkpoint_hints=(10,)))
    assert works[0].saves == [(8, 2), (20, 3)]
    assert checkpoints(mgr) == [(2, "hint", 2), (5, "finish", 3)]
    hit, _ = serve(mgr, make_request([*range(10), *[1] * 10]))
    assert hit.num_tokens == 8 and hit.checkpoint.rule == "hint"


def test_aligned_policy_checkpoints_only_where_a_step_ends_on_a_block_boundary():
    mgr = state_manager(num_checkpoint_slots=4, policy=ALIGNED_POLICY)
    _, works = serve(mgr, make_request(range(10)), chunk=4, outputs=[7, 7])
    assert [w.saves for w in works] == [[(4, 2)], [(4, 3)], [], [], [(1, 4)]]
    assert checkpoints(mgr) == [(1, "step_end", 2), (2, "step_end", 3), (3, "step_end", 4)]
    # Chunks of 6 end on no block boundary: only the decode step that fills block 3 leaves one.
    mgr = state_manager(policy=ALIGNED_POLICY)
    _, works = serve(mgr, make_request(range(10)), chunk=6, outputs=[7, 7])
    assert [w.saves for w in works] == [[], [], [], [(1, 2)]]
    # A prompt parting inside block 3 hits nothing, and leaves nothing where it parts (no junction rule).
    hit, _ = serve(mgr, make_request([*range(8), 1, 1, 1]))
    assert (hit.num_tokens, hit.junction_blocks) == (0, 2)
    assert checkpoints(mgr) == [(3, "step_end", 2)]


def test_budget_evicts_an_orphaned_checkpoint_first_even_when_it_was_hit():
    mgr = state_manager(num_checkpoint_slots=2, num_blocks=6)
    serve(mgr, make_request(range(8)))
    hit, _ = serve(mgr, make_request([*range(8), 1]))  # A's checkpoint is hit once
    assert hit.checkpoint.hits == 1
    serve(mgr, make_request(range(20, 28)))
    assert checkpoints(mgr) == [(2, "finish", 2), (2, "finish", 3)]
    # E needs 4 blocks: two free ones, then A's two, evicted first: A's checkpoint can no longer be reached.
    _, works = serve(mgr, make_request(range(40, 56)))
    assert works[0].saves == [(16, 2)]
    assert checkpoints(mgr) == [(4, "finish", 2), (2, "finish", 3)]


def test_budget_evicts_a_never_hit_sparse_checkpoint_before_an_older_one():
    mgr = state_manager(num_checkpoint_slots=2, policy=CheckpointPolicy(sparse_every_blocks=2))
    serve(mgr, make_request(range(6)))  # its frontier after block 1
    serve(mgr, make_request(range(20, 28)))  # a sparse checkpoint after block 2
    assert checkpoints(mgr) == [(1, "finish", 2), (2, "sparse", 3)]
    _, works = serve(mgr, make_request(range(40, 46)))
    assert works[0].saves == [(4, 3)]
    assert checkpoints(mgr) == [(1, "finish", 2), (1, "finish", 3)]


def test_a_checkpoint_is_found_only_after_the_step_that_saves_it():
    mgr = state_manager()
    a = make_request(range(12))
    assert mgr.allocate_slots(a, 12, mgr.find_prefix(a)) is not None
    assert mgr.find_prefix(make_request([*range(12), 5])).num_tokens == 0  # not written yet
    mgr.take_transfers()
    assert mgr.find_prefix(make_request([*range(12), 5])).num_tokens == 12


def test_no_working_slot_no_admission_and_nothing_changes():
    mgr = state_manager()
    running = [make_request(range(i * 10, i * 10 + 5)) for i in range(2)]
    for req in running:
        step(mgr, req, 5, mgr.find_prefix(req))
    third = make_request(range(50, 55))
    before = manager_state(mgr), checkpoints(mgr)
    assert mgr.allocate_slots(third, 5, mgr.find_prefix(third)) is None
    assert (manager_state(mgr), checkpoints(mgr)) == before
    mgr.free(running[0])  # finished or preempted: its working slot is free again
    assert step(mgr, third, 5, mgr.find_prefix(third)).slot == 0
    mgr.check_invariants()


def test_a_hit_whose_checkpoint_was_evicted_since_the_lookup_is_refused():
    mgr = state_manager(num_checkpoint_slots=1)
    serve(mgr, make_request(range(8)))
    late = make_request([*range(8), 1])
    hit = mgr.find_prefix(late)
    assert hit.num_tokens == 8
    serve(mgr, make_request(range(30, 38)))  # its frontier takes the one slot
    with pytest.raises(ValueError, match="look it up again"):
        mgr.allocate_slots(late, 1, hit)


def test_preempted_request_resumes_from_its_own_frontier():
    mgr = state_manager()
    req = make_request(range(14))
    step(mgr, req, 8, mgr.find_prefix(req))
    mgr.free(req)  # preempted after two blocks
    hit = mgr.find_prefix(req)
    assert hit.num_tokens == 8
    # A new working slot, and a new frontier: the one it left stays a checkpoint like any other.
    assert step(mgr, req, 6, hit) == StateWork(1, restore_from=2, saves=[(4, 3)])


def test_without_caching_a_request_starts_from_zero_and_nothing_is_saved():
    mgr = state_manager(enable_caching=False)
    _, works = serve(mgr, make_request(range(12)), chunk=4)
    assert works == [StateWork(0, zero=True), StateWork(0), StateWork(0)]
    assert checkpoints(mgr) == []


def test_three_kinds_reset_and_sliding_window_with_state():
    groups = (FULL_ATTENTION, KVCacheGroupSpec(sliding_window=8), RECURRENT_STATE)
    mgr = state_manager(groups=groups)
    serve(mgr, make_request(range(24)), chunk=8)
    assert checkpoints(mgr) == [(6, "finish", 2)]
    hit, _ = serve(mgr, make_request([*range(24), 3]))
    assert hit.num_tokens == 24
    assert [len(blocks) for blocks in hit.blocks] == [6, 6, 0]
    assert mgr.block_ids(make_request([1])) == [[], [], []]
    assert mgr.reset_prefix_cache() and checkpoints(mgr) == []
    mgr.check_invariants()


def test_longest_common_hit_with_a_state_group_iterates_until_all_agree():
    groups = (FULL_ATTENTION, KVCacheGroupSpec(sliding_window=8), RECURRENT_STATE)
    full = holding(*range(8))
    # Checkpoints after blocks 5 and 3 (keyed by blocks 4 and 2); the sliding group lacks blocks 4 and 5.
    k, found = longest_common_hit(groups, [full, holding(1, 2, 3, 6, 7), holding(2, 4)], HASHES, 8, BLOCK_SIZE)
    assert (k, found) == (3, [[0, 1, 2], [1, 2], [2]])
    k, found = longest_common_hit(groups, [full, holding(*range(1, 8)), holding(4)], HASHES, 8, BLOCK_SIZE)
    assert (k, found) == (5, [[0, 1, 2, 3, 4], [3, 4], [4]])
    assert longest_common_hit(groups, [full, holding(*range(8)), holding()], HASHES, 8, BLOCK_SIZE) == (
        0,
        [[], [], []],
    )


def test_state_group_kind_and_placement():
    assert RECURRENT_STATE.kind == "mamba" and spec_of_kind("mamba", None) == RECURRENT_STATE
    with pytest.raises(ValueError, match="last"):
        check_groups((RECURRENT_STATE, FULL_ATTENTION))
    with pytest.raises(ValueError, match="last"):
        check_groups((RECURRENT_STATE,))
    with pytest.raises(ValueError, match="no sliding window"):
        KVCacheGroupSpec(sliding_window=4, recurrent_state=True)
    with pytest.raises(ValueError, match="working state slots"):
        KVCacheManager(num_blocks=8, groups=STATE_GROUPS)
    with pytest.raises(ValueError, match="checkpoint hints"):
        make_request(range(4), checkpoint_hints=(5,))


def test_sparse_interval_from_the_budget():
    # A 4,096-token request in blocks of 16 is 256 blocks; 28 checkpoint slots: at most 14 sparse ones.
    assert sparse_interval(4096, 16, 28) == 19
    assert sparse_interval(4096, 16, 1) == 0
    assert sparse_interval(64, 16, 100) == 16  # no closer than 256 tokens
    assert sparse_interval(4096, 4, 1000) == 64
