"""The router's picture of a hybrid backend with offload tiers (full attention and recurrent state): its tiers'
blocks and state checkpoints, by medium, from the backend's KV events, and a predicted hit that is the engine's own
(every attention block on GPU or in a tier, and a checkpoint at exactly the hit's end, on GPU or in a tier)."""

import random

import pytest

from prefixcache.core import FULL_ATTENTION, KVCacheManager, Request, hittable_blocks, root_hash
from prefixcache.core.kv_cache_groups import RECURRENT_STATE
from prefixcache.core.state_table import CheckpointPolicy
from prefixcache.kv_events.collector import KVEventCollector
from prefixcache.offload import HostMemoryStore
from prefixcache.offload.connector import WRITE_BACK, WRITE_THROUGH, OffloadConnector, TierWriter
from prefixcache.router.blocks import EngineKeyedBlocks
from prefixcache.router.index import PrefixIndex
from prefixcache.router.wire import external_block_hash
from tests.offload.conftest import make_layout
from tests.offload.test_connector_states import STATE_BYTES, run_step
from tests.router.test_index import BLOCK, FULL_KIND, feed_events, random_manager_step, removed_event, store_event

STATE_KIND = "mamba"


def state_backend(index, name="h"):
    """A backend whose events teach the index full attention (0) and recurrent state (1), with blocks 1..6 on
    GPU and no checkpoint yet."""
    blocks = EngineKeyedBlocks(index, name, BLOCK)
    blocks.store(store_event([1, 2, 3, 4, 5, 6], 0, FULL_KIND))
    blocks.store(store_event([], 1, STATE_KIND))
    return blocks


def test_a_tier_checkpoint_ends_the_hit_where_the_tiers_blocks_reach_it():
    index = PrefixIndex()
    blocks = state_backend(index)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert index.matched_blocks(prompt, ["h"]) == {"h": 0}  # no checkpoint anywhere: the state starts from zero
    blocks.store(store_event([2], 1, STATE_KIND))  # the device's checkpoint after block 2
    blocks.store(store_event([7, 8, 9], 0, FULL_KIND, medium="CPU"))  # the host tier continues the blocks
    assert index.matched_blocks(prompt, ["h"]) == {"h": 2}  # the tier's blocks alone add nothing
    blocks.store(store_event([8], 1, STATE_KIND, medium="CPU"))  # the tier's checkpoint after block 8
    assert index.matched_blocks(prompt, ["h"]) == {"h": 8}
    blocks.store(store_event([6], 1, STATE_KIND, medium="CPU"))  # a shallower one: the deepest wins
    assert index.matched_blocks(prompt, ["h"]) == {"h": 8}
    blocks.remove(removed_event([8], 1, medium="CPU"))
    assert index.matched_blocks(prompt, ["h"]) == {"h": 6}
    blocks.remove(removed_event([8], 0, medium="CPU"))  # the tier's run ends before block 8 now
    blocks.store(store_event([9], 1, STATE_KIND, medium="CPU"))
    assert index.matched_blocks(prompt, ["h"]) == {"h": 6}
    blocks.remove(removed_event([4], 0))  # the device lost block 4: the tier's run no longer follows on
    assert index.matched_blocks(prompt, ["h"]) == {"h": 2}
    assert index.holds("h", 9, "CPU", 1) and not index.holds("h", 9, "GPU") and not index.holds("h", 8, group=1)


def test_a_tier_checkpoint_on_a_block_the_tier_does_not_follow_on_to_is_no_hit():
    """A tier checkpoint past a gap in the blocks (device, then tier) is out of reach: the engine would have to
    compute the blocks in the gap, so it starts where its blocks end."""
    index = PrefixIndex()
    blocks = state_backend(index)
    blocks.store(store_event([9], 0, FULL_KIND, medium="CPU"))
    blocks.store(store_event([9], 1, STATE_KIND, medium="CPU"))
    assert index.matched_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], ["h"]) == {"h": 0}


@pytest.mark.parametrize("mode", [WRITE_BACK, WRITE_THROUGH])
def test_the_router_reading_a_hybrid_engines_tier_events_predicts_every_lookup_exactly(mode):
    """A real manager on full attention and recurrent state, with a small host tier (write-back: blocks and
    checkpoints go there when the device evicts them; write-through: when they are computed) and the connector's
    fake worker; its events through the collector, the wire and the router's decoder. A random mix of chunked
    prefills, decodes and frees evicts on the device and in the tier; prediction == lookup after every step."""
    rng = random.Random(3)
    groups = (FULL_ATTENTION, RECURRENT_STATE)
    layout = make_layout(root_hash=root_hash("sha256"), block_size=BLOCK, state_bytes=STATE_BYTES)
    stores = [HostMemoryStore(layout, 14 * layout.block_bytes)]
    collector = KVEventCollector(groups=groups)
    connector = OffloadConnector(stores, BLOCK, mode, TierWriter(stores, background=False), tier_listeners=[collector])
    manager = KVCacheManager(
        num_blocks=16,
        block_size=BLOCK,
        connector=connector,
        groups=groups,
        listeners=[collector],
        num_state_slots=4,
        num_checkpoint_slots=3,
        checkpoint_policy=CheckpointPolicy(2),
    )
    index = PrefixIndex()
    blocks = EngineKeyedBlocks(index, "h", BLOCK)  # groups learned from the events alone
    prefixes = [[rng.randrange(50) for _ in range(n)] for n in (9, 20, 26)]
    running = []
    from_tiers = differs = 0
    for step in range(300):
        random_manager_step(manager, rng, prefixes, running, step)
        run_step(manager, connector)  # the step's plan, its copies out to the tier
        manager.take_transfers()  # the next step delivers what the tier wrote in this one
        feed_events(collector, blocks, step)
        for prefix in prefixes:
            for cut in (0, 3, 6):  # the whole prefix, or one that parts inside it (where no checkpoint may be)
                probe = Request("probe", prefix[: len(prefix) - cut] + [7])
                hittable = manager.block_hashes(probe)[: hittable_blocks(probe.num_tokens, BLOCK)]
                hashes = [external_block_hash(h) for h in hittable]
                predicted = index.matched_blocks(hashes, ["h"])["h"] * BLOCK
                found = manager.lookup(probe.prompt_token_ids)
                assert predicted == found.cached_tokens
                from_tiers += found.cached_tokens_by_tier["CPU"] > 0
                held = next((i for i, h in enumerate(hashes) if not index.holds("h", h)), len(hashes))
                differs += held * BLOCK != predicted
    assert from_tiers > 100  # the tier served many of the hits
    assert differs > 300  # where a hash held in some group or medium is no hit
