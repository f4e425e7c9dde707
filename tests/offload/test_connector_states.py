"""The connector on a model with recurrent layers, without a model: which checkpoint each state record carries,
when the tiers get it (computed: write-through; evicted by the checkpoint budget: write-back), and how far a hit
from the tiers reaches (every attention block and a checkpoint at exactly its end, from the pool or a tier).

Blocks of 4 tokens; state slots 0 and 1 are the working states, the checkpoint slots follow. A fake worker stores
payloads that name their key, so a mixed-up record is caught."""

import pytest

from prefixcache.core import FULL_ATTENTION, KVCacheManager, Request, root_hash
from prefixcache.core.kv_cache_groups import RECURRENT_STATE
from prefixcache.core.kv_cache_manager import PrefixHit
from prefixcache.core.retention import RetentionRange
from prefixcache.core.state_table import StateWork
from prefixcache.offload import DiskStore, HostMemoryStore
from prefixcache.offload.connector import WRITE_BACK, WRITE_THROUGH, OffloadConnector, StateLoad, StateSave, TierWriter
from prefixcache.offload.record import state_key
from tests.core.conftest import FakeConnector
from tests.offload.conftest import make_layout
from tests.offload.test_connector import B, kv, make_request

STATE_BYTES = 24
GROUPS = (FULL_ATTENTION, RECURRENT_STATE)
PROMPT = [*range(1000, 1008), 1, 2, 3]  # the first 8 tokens of make_request(10) and 3 others


def make(
    mode=WRITE_BACK, tiers=("cpu",), tmp_path=None, num_blocks=6, num_checkpoint_slots=1, min_priority=0, **kwargs
):
    layout = make_layout(root_hash=root_hash("sha256"), block_size=B, state_bytes=STATE_BYTES)
    stores = [
        HostMemoryStore(layout, 100 * layout.block_bytes)
        if tier == "cpu"
        else DiskStore(layout, tmp_path / "disk", 100 * 2 * layout.block_bytes)
        for tier in tiers
    ]
    connector = OffloadConnector(stores, B, mode, TierWriter(stores, background=False), min_priority=min_priority)
    manager = KVCacheManager(
        num_blocks=num_blocks,
        block_size=B,
        connector=connector,
        groups=GROUPS,
        num_state_slots=2,
        num_checkpoint_slots=num_checkpoint_slots,
        **kwargs,
    )
    return manager, connector


def state(key) -> bytes:
    """A checkpoint payload that names its key."""
    return (key * (STATE_BYTES // len(key) + 1))[:STATE_BYTES]


def run_step(manager, connector):
    """End the step as the engine does (take the plan) and do the worker's copies out; returns the plan."""
    plan = manager.take_transfers()[1]
    layout = connector.stores[0].layout
    for save in plan.save_before + plan.save_after:
        kept = {save.block_hash: save.retention} if save.retention else None
        connector.writer.submit(save.tiers, [(save.block_hash, kv(layout, save.block_hash))], kept)
    for save in plan.state_save_before + plan.state_save_after:
        kept = {save.key: save.retention} if save.retention else None
        connector.writer.submit(save.tiers, [(save.key, state(save.key))], kept)
    return plan


def serve(manager, connector, request):
    """Look up, prefill the whole prompt in one step, free: (the hit, the admission's state work, its plan)."""
    hit = manager.find_prefix(request)
    assert manager.allocate_slots(request, request.num_tokens - hit.num_tokens, hit) is not None
    work = manager.state_work(request)
    plan = run_step(manager, connector)
    manager.free(request)
    manager.check_invariants()
    return hit, work, plan


def test_a_state_record_is_the_checkpoint_at_the_end_of_its_block_saved_when_computed(tmp_path):
    """Write-through: the step that computes a request's last full block saves its frontier checkpoint there; the
    tiers get it from that slot under the hash of the block it ends (block 1, 8 tokens), beside the blocks."""
    manager, connector = make(WRITE_THROUGH, tiers=("cpu", "disk"), tmp_path=tmp_path)
    a = make_request(10)
    hashes = manager.block_hashes(a)
    _, work, plan = serve(manager, connector, a)
    assert work.saves == [(8, 2)]
    assert [save.block_hash for save in plan.save_after] == hashes[:2]
    assert plan.state_save_after == [StateSave(2, state_key(hashes[1]), (0, 1))]
    for store in connector.stores:
        assert store.load_prefix([state_key(hashes[1])]) == [state(state_key(hashes[1]))]
        assert not store.held_prefix([state_key(hashes[0])])  # no checkpoint at block 1's start


def test_write_back_demotes_the_checkpoint_the_budget_evicts_and_its_blocks_when_the_pool_evicts_them():
    """One checkpoint slot: B's frontier evicts A's checkpoint, demoted from its slot before B's forward pass
    overwrites it; C's blocks then evict A's, tail first. D, A's 8 tokens and more, finds nothing on the device and
    all 8 in the host tier: both blocks loaded into new blocks, the checkpoint into D's working state."""
    manager, connector = make(WRITE_BACK, num_blocks=5)
    a = make_request(10)
    hashes = manager.block_hashes(a)
    serve(manager, connector, a)
    _, _, plan = serve(manager, connector, make_request(10, start=2000, request_id="b"))
    assert plan.state_save_before == [StateSave(2, state_key(hashes[1]), (0,))]
    assert manager.state.lookup(hashes[1]) is None
    _, _, plan = serve(manager, connector, make_request(10, start=3000, request_id="c"))
    assert [save.block_hash for save in plan.save_before] == [hashes[1], hashes[0]]
    assert manager.lookup(PROMPT).cached_tokens_by_tier == {"device": 0, "CPU": 8}
    d = Request("d", PROMPT)
    hit, work, plan = serve(manager, connector, d)
    assert (hit.num_local_tokens, hit.num_external_tokens, hit.external_state) == (0, 8, True)
    assert work == StateWork(1)  # nor zeroed nor restored: the load fills it (slot 1: the working slots rotate)
    assert [load.block_hash for load in plan.loads] == hashes[:2]
    assert plan.state_loads == [StateLoad(1, state_key(hashes[1]), state(state_key(hashes[1])), 0)]
    assert manager.stats.hits == 8
    assert state_key(hashes[1]) in connector.stores[0]  # the host tier keeps it: no device checkpoint holds it


def test_blocks_on_the_device_and_the_checkpoint_in_a_tier_make_one_hit():
    """A's blocks stay on the device, its checkpoint went to the host tier: D hits all 8 tokens, its blocks from
    the pool, its state from the tier; nothing else is loaded."""
    manager, connector = make(WRITE_BACK, num_blocks=12)
    a = make_request(10)
    hashes = manager.block_hashes(a)
    serve(manager, connector, a)
    serve(manager, connector, make_request(10, start=2000, request_id="b"))
    assert manager.lookup(PROMPT).cached_tokens_by_tier == {"device": 8, "CPU": 0}
    d = Request("d", PROMPT)
    hit, work, plan = serve(manager, connector, d)
    assert (hit.num_local_tokens, hit.num_external_tokens, hit.external_state, work.zero) == (8, 0, True, False)
    assert [b.block_hash for b in hit.blocks[0]] == hashes[:2]
    assert not plan.loads and plan.state_loads == [StateLoad(0, state_key(hashes[1]), state(state_key(hashes[1])), 0)]


def test_a_tier_hit_needs_a_checkpoint_at_exactly_its_end(tmp_path):
    """The disk tier holds A's 4 blocks and its checkpoint after them, the device nothing (reset). X shares 3 of the
    blocks: no checkpoint at 3, no hit (and no junction: the device holds none of them); X leaves its own frontier
    at 3. Y, A's prompt again, then hits 16 tokens: 3 blocks on the device, block 3 and the deeper checkpoint
    (at 4, not X's at 3) from the disk."""
    manager, connector = make(WRITE_BACK, tiers=("disk",), tmp_path=tmp_path, num_blocks=12)
    a = make_request(18)
    hashes = manager.block_hashes(a)
    serve(manager, connector, a)
    assert manager.reset_prefix_cache()
    x = Request("x", [*range(1000, 1012), 7, 7, 7])
    assert manager.lookup(x.prompt_token_ids).cached_tokens == 0
    hit, work, _ = serve(manager, connector, x)
    assert (hit.num_tokens, hit.junction_blocks, work.zero) == (0, 0, True)
    assert manager.state.lookup(hashes[2]) is not None
    y = make_request(18, request_id="y")
    assert manager.lookup(y.prompt_token_ids).cached_tokens_by_tier == {"device": 12, "DISK": 4}
    hit, work, plan = serve(manager, connector, y)
    assert (hit.num_local_tokens, hit.num_external_tokens, hit.checkpoint, work.zero) == (12, 4, None, False)
    assert [load.block_hash for load in plan.loads] == [hashes[3]]
    assert [load.key for load in plan.state_loads] == [state_key(hashes[3])]


def test_a_demoted_checkpoint_keeps_its_blocks_retention():
    """A retained prefix's checkpoint goes to the host tier at the block's priority, with the TTL it has left."""
    manager, connector = make(WRITE_BACK, num_blocks=12)
    a = Request("a", list(range(1000, 1010)), retention=[RetentionRange(0, 8, 80, 600.0)])
    serve(manager, connector, a)
    _, _, plan = serve(manager, connector, make_request(10, start=2000, request_id="b"))
    [save] = plan.state_save_before
    priority, left = save.retention
    assert priority == 80 and 0 < left <= 600.0


def test_a_checkpoint_below_the_minimum_priority_is_dropped_as_its_block_is():
    """With ``min_priority`` 36 only A's retained prefix offloads: its checkpoint (block at 80) is demoted, B's
    (default priority) is dropped when C's evicts it."""
    manager, connector = make(WRITE_BACK, num_blocks=12, min_priority=36)
    a = Request("a", list(range(1000, 1010)), retention=[RetentionRange(0, 8, 80, 600.0)])
    serve(manager, connector, a)
    _, _, plan = serve(manager, connector, make_request(10, start=2000, request_id="b"))
    assert [save.key for save in plan.state_save_before] == [state_key(manager.block_hashes(a)[1])]
    _, _, plan = serve(manager, connector, make_request(10, start=3000, request_id="c"))
    assert plan.state_save_before == []


def test_a_hybrid_cache_refuses_a_connector_that_keeps_no_checkpoints():
    with pytest.raises(ValueError, match="does not carry recurrent-state checkpoints"):
        KVCacheManager(num_blocks=8, block_size=B, groups=GROUPS, num_state_slots=2, connector=FakeConnector())


def test_a_hit_that_claims_a_tier_checkpoint_without_blocks_is_misuse_and_changes_nothing():
    manager, _ = make()
    request = make_request(10)
    with pytest.raises(ValueError, match="a state from the connector needs a hit of blocks"):
        manager.allocate_slots(request, 10, PrefixHit([[], []], external_state=True))
    assert manager.block_ids(request) == [[], []] and manager.state.has_working_slot
    manager.check_invariants()
