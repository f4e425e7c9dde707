"""The router's index: which backend holds which hash, per medium, and the longest held prefix."""

import random

import msgspec
import pytest

from prefixcache.core import FULL_ATTENTION, KVCacheGroupSpec, KVCacheManager, Request, hittable_blocks
from prefixcache.core.retention import RetentionRange
from prefixcache.kv_events.collector import KVEventCollector
from prefixcache.kv_events.events import KVEventBatch
from prefixcache.router import wire
from prefixcache.router.blocks import MAX_KV_CACHE_GROUPS, BadEventError, ContentKeyedBlocks, EngineKeyedBlocks
from prefixcache.router.index import IndexListener, PrefixIndex
from prefixcache.router.metrics import RouterMetrics
from prefixcache.router.prompt import PromptHasher
from prefixcache.router.wire import external_block_hash


def test_longest_prefix_held_without_a_gap_per_backend():
    index = PrefixIndex()
    index.store("a", [1, 2, 3])
    index.store("b", [1, 3])
    assert index.matched_blocks([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
    assert index.matched_blocks([9, 1], ["a"]) == {"a": 0}


def test_a_hash_stays_while_any_medium_holds_it():
    index = PrefixIndex()
    index.store("a", [1], "GPU")
    index.store("a", [1], "CPU")
    index.remove("a", [1], "GPU")
    assert index.matched_blocks([1], ["a"]) == {"a": 1}
    index.remove("a", [1], "CPU")
    assert index.matched_blocks([1], ["a"]) == {"a": 0}
    assert len(index) == 0 and index.num_blocks("a") == 0


def test_removing_an_unknown_hash_changes_nothing():
    index = PrefixIndex()
    index.store("a", [1])
    index.remove("a", [2])
    index.remove("b", [1])
    assert index.matched_blocks([1], ["a", "b"]) == {"a": 1, "b": 0}


def test_clearing_one_backend_keeps_the_others():
    index = PrefixIndex()
    index.store("a", [1, 2])
    index.store("b", [1])
    index.clear("a")
    assert index.matched_blocks([1, 2], ["a", "b"]) == {"a": 0, "b": 1}
    assert len(index) == 1


def test_clearing_one_medium_keeps_what_other_media_hold():
    index = PrefixIndex()
    index.store("a", [1, 2, 3])
    index.store("a", [1, 2], "CPU")
    index.clear("a", "GPU")
    assert index.matched_blocks([1, 2, 3], ["a"]) == {"a": 2}
    assert index.num_blocks("a") == 2 and len(index) == 2


def test_gpu_blocks_count_each_hash_held_on_gpu_once_whatever_its_groups_and_tiers():
    index = PrefixIndex()
    index.store("a", [1, 2, 3], group=0)
    index.store("a", [2, 3], group=1)  # a second group's copies of the same hashes
    index.store("a", [3, 4], "CPU")
    index.store("b", [1])
    assert index.gpu_blocks("a") == 3 and index.gpu_blocks("b") == 1 and index.gpu_blocks("c") == 0
    index.remove("a", [3], group=0)
    assert index.gpu_blocks("a") == 3  # group 1 still holds 3
    index.remove("a", [3], group=1)
    index.remove("a", [9])  # unknown: nothing changes
    assert index.gpu_blocks("a") == 2
    index.hold("a", [7, 8])  # in flight: not in the cache yet
    assert index.gpu_blocks("a") == 2
    index.clear("a", "GPU")
    assert index.gpu_blocks("a") == 0 and index.num_blocks("a") == 2  # the tier keeps 3 and 4
    index.store("a", [5])
    index.clear("a")
    assert index.gpu_blocks("a") == 0 and index.gpu_blocks("b") == 1


def test_hashes_of_requests_in_flight_count_as_held_until_each_is_released():
    index = PrefixIndex()
    index.store("a", [1])
    index.hold("b", [1, 2])
    index.hold("b", [1, 2])
    assert index.matched_blocks([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 2}
    assert len(index) == 1 and index.num_blocks("b") == 0  # the index's size is what events said
    index.release("b", [1, 2])
    assert index.matched_blocks([1, 2], ["b"]) == {"b": 2}
    index.release("b", [1, 2])
    assert index.matched_blocks([1, 2], ["b"]) == {"b": 0}
    # events and a request in flight join into one prefix; a clear forgets the events, not the request
    index.store("b", [1])
    index.hold("b", [2])
    assert index.matched_blocks([1, 2], ["b"]) == {"b": 2}
    index.clear("b")
    assert index.matched_blocks([1, 2], ["b"]) == {"b": 0}
    assert index.matched_blocks([2], ["b"]) == {"b": 1}


@pytest.mark.parametrize("groups", [(FULL_ATTENTION,), (KVCacheGroupSpec(8), FULL_ATTENTION)], ids=["plain", "hybrid"])
def test_a_listener_on_real_pools_predicts_every_lookup_exactly(groups):
    """Prompts over shared prefixes through two small caches with eviction: prediction == the manager's hit."""
    rng = random.Random(3)
    index = PrefixIndex()
    managers = {}
    for name in ("a", "b"):
        listener = IndexListener(index, name, groups)
        managers[name] = KVCacheManager(num_blocks=24, block_size=4, groups=groups, listeners=[listener])
    prefixes = [[rng.randrange(1000) for _ in range(12)] for _ in range(5)]
    for i in range(200):
        name = rng.choice("ab")
        manager = managers[name]
        request = Request(str(i), rng.choice(prefixes)[: rng.randint(4, 12)] + [rng.randrange(1000)])
        hittable = (request.num_tokens - 1) // 4
        hashes = [external_block_hash(h) for h in manager.block_hashes(request)[:hittable]]
        predicted = index.matched_blocks(hashes, [name])[name] * 4
        hit = manager.find_prefix(request)
        num_cached = hit.num_tokens
        assert predicted == num_cached
        manager.allocate_slots(request, request.num_tokens - num_cached, hit)
        manager.free(request)

    def cached_hashes(manager) -> int:
        return len(set().union(*manager.pool.cached))

    for name, manager in managers.items():
        assert index.num_blocks(name) == cached_hashes(manager)
    managers["a"].reset_prefix_cache()
    assert index.num_blocks("a") == 0 and index.num_blocks("b") == cached_hashes(managers["b"])


# ---- KV cache groups: a hybrid backend's hit is the engine's rule over each group's blocks ----------------------

BLOCK = 4
FULL_KIND, SLIDING_KIND = "full_attention", "sliding_window"
WINDOW = 8  # two blocks of 4 before a hit's end


def store_event(hashes, group, kind=None, window=None, medium="GPU", block_size=BLOCK):
    return wire.BlockStored(
        block_hashes=hashes,
        block_size=block_size,
        medium=medium,
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
    )


def removed_event(hashes, group, medium="GPU"):
    return wire.BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)


def hybrid_backend(index, name="h"):
    """A backend whose events teach the index two groups: full attention (0) and a window of 8 (1)."""
    blocks = EngineKeyedBlocks(index, name, BLOCK)
    blocks.store(store_event([1, 2, 3, 4, 5, 6], 0, FULL_KIND))
    blocks.store(store_event([1, 2, 3, 4, 5, 6], 1, SLIDING_KIND, WINDOW))
    return blocks


def test_a_full_group_that_lost_an_early_block_bounds_the_hit_though_the_sliding_group_holds_it():
    index = PrefixIndex()
    blocks = hybrid_backend(index)
    assert index.matched_blocks([1, 2, 3, 4, 5, 6], ["h"]) == {"h": 6}
    blocks.remove(removed_event([3], 0))  # the full group evicted block 2; the sliding group still holds it
    assert index.holds("h", 3)  # held by some group: the any-group rule would predict all 6 blocks
    # the full group's run ends at 2 blocks, whose window (blocks 0 and 1) the sliding group holds
    assert index.matched_blocks([1, 2, 3, 4, 5, 6], ["h"]) == {"h": 2}
    blocks.remove(removed_event([1], 1))  # now the sliding group lacks block 0 of that window too
    assert index.matched_blocks([1, 2, 3, 4, 5, 6], ["h"]) == {"h": 0}


def test_a_sliding_group_serves_a_long_hit_without_the_blocks_before_its_window_but_not_a_short_one():
    index = PrefixIndex()
    blocks = hybrid_backend(index)
    blocks.remove(removed_event([1, 2, 3], 1))  # blocks 0..2 left the window and were evicted there
    assert index.matched_blocks([1, 2, 3, 4, 5, 6], ["h"]) == {"h": 6}  # the window before 6: blocks 4, 5
    assert index.matched_blocks([1, 2, 3, 4, 5, 6, 7], ["h"]) == {"h": 6}
    # a prompt of three blocks needs blocks 1 and 2 in the sliding group: no length of it is served
    assert index.matched_blocks([1, 2, 3], ["h"]) == {"h": 0}
    # a hole inside the window lowers the hit to the next point whose window is held
    blocks.remove(removed_event([5], 1))
    assert index.matched_blocks([1, 2, 3, 4, 5, 6], ["h"]) == {"h": 0}
    blocks.store(store_event([2, 3], 1))  # stored again (the spec is known by now)
    assert index.matched_blocks([1, 2, 3, 4, 5, 6], ["h"]) == {"h": 4}  # 4's window: blocks 2, 3


def test_groups_reported_by_the_config_predict_before_any_event_names_a_spec():
    index = PrefixIndex()
    blocks = EngineKeyedBlocks(index, "h", BLOCK, (FULL_ATTENTION, KVCacheGroupSpec(WINDOW)))
    assert index.matched_blocks([1, 2], ["h"]) == {"h": 0}
    blocks.store(store_event([1, 2, 3], 0))  # events without spec fields: the reported groups hold
    assert index.matched_blocks([1, 2, 3], ["h"]) == {"h": 0}  # the sliding group holds nothing yet
    blocks.store(store_event([2, 3], 1))
    assert index.matched_blocks([1, 2, 3], ["h"]) == {"h": 3}
    blocks.clear()  # a restart: the entries go, the reported groups stay
    blocks.store(store_event([1, 2, 3], 0))
    assert index.matched_blocks([1, 2, 3], ["h"]) == {"h": 0}


def test_a_reset_clears_every_group_and_the_tiers_continue_the_gpu_hit():
    index = PrefixIndex()
    blocks = hybrid_backend(index)
    for group, kind, window in ((0, FULL_KIND, None), (1, SLIDING_KIND, WINDOW)):
        blocks.store(store_event([1, 2, 3, 4, 5, 6, 7, 8], group, kind, window, medium="CPU"))
    blocks.remove(removed_event([5], 0))
    # GPU: the full group's run is 4 blocks (window held); the tier holds blocks 4.. in every group
    assert index.matched_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], ["h"]) == {"h": 8}
    blocks.clear("GPU")  # AllBlocksCleared: the engine's own cache in every group, not its tier
    assert index.matched_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], ["h"]) == {"h": 8}
    blocks.clear("CPU")
    assert index.matched_blocks([1, 2], ["h"]) == {"h": 0} and index.num_blocks("h") == 0


def test_single_group_backends_keep_the_any_copy_rule_beside_a_hybrid_one():
    index = PrefixIndex()
    hybrid_backend(index).remove(removed_event([1], 0))
    plain = EngineKeyedBlocks(index, "p", BLOCK, (FULL_ATTENTION,))
    plain.store(store_event([1, 2, 3], 0, FULL_KIND))
    old = EngineKeyedBlocks(index, "old", BLOCK)  # events without group fields (an engine without groups)
    old.store(store_event([1, 2], None))
    assert index.matched_blocks([1, 2, 3], ["h", "p", "old", "none"]) == {"h": 0, "p": 3, "old": 2, "none": 0}


def test_requests_in_flight_count_in_every_group():
    index = PrefixIndex()
    blocks = hybrid_backend(index)
    blocks.remove(removed_event([6], 0))
    index.hold("h", [6, 7])
    assert index.matched_blocks([1, 2, 3, 4, 5, 6, 7], ["h"]) == {"h": 7}
    index.release("h", [6, 7])
    assert index.matched_blocks([1, 2, 3, 4, 5, 6, 7], ["h"]) == {"h": 5}


def test_a_group_the_router_cannot_predict_routes_the_backend_by_load(caplog):
    index = PrefixIndex()
    blocks = hybrid_backend(index)
    blocks.store(store_event([1, 2], 2, "chunked_local_attention"))
    blocks.store(store_event([3], 2, "chunked_local_attention"))
    assert index.matched_blocks([1, 2], ["h"]) == {"h": 0}
    assert caplog.text.count("KV cache group of kind 'chunked_local_attention', whose hits the router cannot") == 1


def test_a_recurrent_state_group_bounds_the_hit_to_its_deepest_checkpoint():
    """A mamba group's stored blocks are state checkpoints, each keyed by the block it ends."""
    index = PrefixIndex()
    blocks = hybrid_backend(index)
    assert index.matched_blocks([1, 2, 3, 4, 5, 6], ["h"]) == {"h": 6}
    blocks.store(store_event([4], 2, "mamba"))  # a checkpoint after 4 blocks
    assert index.matched_blocks([1, 2, 3, 4, 5, 6], ["h"]) == {"h": 4}
    blocks.store(store_event([6], 2, "mamba"))
    assert index.matched_blocks([1, 2, 3, 4, 5, 6], ["h"]) == {"h": 6}
    blocks.remove(removed_event([6], 2))
    assert index.matched_blocks([1, 2, 3, 4, 5, 7], ["h"]) == {"h": 4}


def test_events_that_cannot_name_a_group_are_refused_and_change_nothing():
    index = PrefixIndex()
    blocks = hybrid_backend(index)
    for bad in (
        store_event([7], -1, FULL_KIND),
        store_event([7], MAX_KV_CACHE_GROUPS, FULL_KIND),
        store_event([7], 1, SLIDING_KIND, None),
        store_event([7], 1, SLIDING_KIND, 0),
    ):
        with pytest.raises(BadEventError):
            blocks.store(bad)
    with pytest.raises(BadEventError):
        blocks.remove(removed_event([1], -1))
    assert not index.holds("h", 7)
    assert index.matched_blocks([1, 2, 3, 4, 5, 6], ["h"]) == {"h": 6}


def test_a_content_keyed_backend_keys_each_group_by_the_tokens():
    """A vLLM-like backend with hybrid groups: each group's stores name the same random ids; its removals
    and the rule apply per group."""
    index = PrefixIndex()
    blocks = ContentKeyedBlocks(index, "v", RouterMetrics(), BLOCK)
    tokens = list(range(100, 124))  # 6 blocks
    rng = random.Random(1)
    theirs = [rng.getrandbits(64) for _ in range(6)]
    for group, kind, window in ((0, FULL_KIND, None), (1, SLIDING_KIND, WINDOW)):
        event = store_event(theirs, group, kind, window)
        blocks.store(msgspec.structs.replace(event, token_ids=tokens))
    hasher = PromptHasher.by_content(None, BLOCK)
    ours = hasher.key(tokens + [1]).block_hashes
    assert index.matched_blocks(ours, ["v"]) == {"v": 6}
    blocks.remove(removed_event(theirs[2:3], 0))  # the full group evicted block 2
    assert index.matched_blocks(ours, ["v"]) == {"v": 2}
    blocks.remove(removed_event(theirs[:3], 1))
    assert index.matched_blocks(ours, ["v"]) == {"v": 0}
    assert len(blocks) == 5  # block 2 is gone from both groups, the others some group still holds


def test_the_router_reading_a_hybrid_engines_events_predicts_every_lookup_exactly():
    """A real hybrid manager's events through the collector, the wire and the router's decoder: a random mix of
    chunked prefills, decodes and frees on a small pool, evicting in both groups; prediction == lookup."""
    rng = random.Random(5)
    groups = (FULL_ATTENTION, KVCacheGroupSpec(WINDOW))
    collector = KVEventCollector(groups=groups)
    manager = KVCacheManager(num_blocks=31, block_size=BLOCK, groups=groups, listeners=[collector])
    index = PrefixIndex()
    blocks = EngineKeyedBlocks(index, "h", BLOCK)  # groups learned from the events alone
    prefixes = [[rng.randrange(50) for _ in range(n)] for n in (9, 20, 26)]
    running = []
    differs = 0
    for step in range(300):
        random_manager_step(manager, rng, prefixes, running, step)
        feed_events(collector, blocks, step)
        for prefix in prefixes:
            for extra in (1, 4):
                probe = Request("probe", prefix + [7] * extra)
                hittable = manager.block_hashes(probe)[: hittable_blocks(probe.num_tokens, BLOCK)]
                hashes = [external_block_hash(h) for h in hittable]
                predicted = index.matched_blocks(hashes, ["h"])["h"] * BLOCK
                assert predicted == manager.lookup(probe.prompt_token_ids).cached_tokens
                held = next((i for i, h in enumerate(hashes) if not index.holds("h", h)), len(hashes))
                differs += held * BLOCK != predicted
    assert differs > 50  # the any-group rule would have been wrong this often


class RouterClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def retained_event(hashes, retention, medium="GPU"):
    return msgspec.structs.replace(store_event(hashes, None, medium=medium), retention=retention)


def test_events_retention_marks_blocks_until_their_ttl_ends_then_they_count_at_the_default():
    clock = RouterClock()
    index = PrefixIndex(clock=clock)
    blocks = EngineKeyedBlocks(index, "a", BLOCK)
    blocks.store(retained_event([1, 2, 3, 4], [[90, 60.0], [90, 60.0], [35, None], [10, 30.0]]))
    blocks.store(retained_event([1, 2], [[90, 60.0], [90, 60.0]], medium="CPU"))  # a tier's copy: not the GPU's
    assert [index.retention("a", h) for h in (1, 2, 3, 4, 5)] == [90, 90, 35, 10, 35]
    assert index.retained_run("a", [1, 2, 3, 4]) == 2
    assert index.retained_run("a", [2, 1]) == 2 and index.retained_run("a", [3, 1]) == 0
    clock.now += 30  # block 4's TTL ended
    assert index.retention("a", 4) == 35
    blocks.remove(removed_event([2], None))  # evicted from the GPU: the run stops there
    assert index.retained_run("a", [1, 2, 3]) == 1
    clock.now += 30  # block 1's ended: what the backend holds counts at the default
    assert index.retained_run("a", [1]) == 0 and index.retention("a", 1) == 35
    assert index.matched_blocks([1, 2, 3], ["a"]) == {"a": 3}  # still held (CPU holds 2): only its priority went


def test_a_reset_or_a_restart_forgets_the_retention():
    index = PrefixIndex(clock=RouterClock())
    blocks = EngineKeyedBlocks(index, "a", BLOCK)
    blocks.store(retained_event([1, 2], [[90, 60.0], [90, 60.0]]))
    blocks.clear("GPU")
    blocks.store(store_event([1, 2], None))  # computed again without a directive
    assert index.retained_run("a", [1, 2]) == 0
    blocks.store(retained_event([1, 2], [[90, 60.0], [90, 60.0]]))
    blocks.clear()
    assert index.retention("a", 1) == 35 and not index.holds("a", 1)


def test_a_content_keyed_backend_keeps_the_retention_of_the_blocks_it_can_name():
    index = PrefixIndex(clock=RouterClock())
    blocks = ContentKeyedBlocks(index, "v", RouterMetrics(), BLOCK)
    tokens = list(range(100, 112))  # 3 blocks
    blocks.store(
        msgspec.structs.replace(
            retained_event([7, 8, 9], [[80, 60.0], [80, 60.0], [35, None]]), token_ids=tokens, group_idx=None
        )
    )
    ours = PromptHasher.by_content(None, BLOCK).key(tokens + [1]).block_hashes
    assert index.retained_run("v", ours) == 2 and [index.retention("v", h) for h in ours] == [80, 80, 35]


def test_retention_reaches_the_router_through_the_wire_from_a_real_manager():
    """A manager's events with a 24h directive, through the collector, msgpack and the router's decoder."""
    collector = KVEventCollector()
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK, listeners=[collector])
    request = Request("r", list(range(50, 50 + 3 * BLOCK + 1)), retention=(RetentionRange(0, 2 * BLOCK, 90, 86400),))
    manager.allocate_slots(request, request.num_tokens, manager.find_prefix(request))
    payload = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=collector.take()))
    index = PrefixIndex(clock=RouterClock())
    blocks = EngineKeyedBlocks(index, "h", BLOCK)
    for event in wire.decode_batch(payload).events:
        blocks.store(event)
    hashes = [external_block_hash(h) for h in manager.block_hashes(request)[:3]]
    assert [index.retention("h", h) for h in hashes] == [90, 90, 35]
    assert index.retained_run("h", hashes) == 2


def random_manager_step(manager: KVCacheManager, rng: random.Random, prefixes, running: list, step: int) -> None:
    """One step of a random mix on a real manager: free a running request, advance one (a chunk of its prompt
    or a decoded token), or admit a new request on one of ``prefixes`` in a chunk; a request that finds no room
    is freed (dropping what a connector staged for it)."""
    if running and rng.random() < 0.4:
        manager.free(running.pop(rng.randrange(len(running))))
    elif running and rng.random() < 0.6:
        request = rng.choice(running)
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids([rng.randrange(50)])
        manager.allocate_slots(request, min(rng.randrange(1, 9), request.num_tokens - request.num_computed_tokens))
    else:
        request = Request(f"r{step}", rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 5))])
        hit = manager.find_prefix(request)
        chunk = min(rng.randrange(1, 16), request.num_tokens - hit.num_tokens)
        if manager.allocate_slots(request, chunk, hit) is not None:
            running.append(request)
        else:
            manager.free(request)


def feed_events(collector: KVEventCollector, blocks: EngineKeyedBlocks, step: int) -> None:
    """What the collector holds, through the wire (msgpack) and the router's decoder, into its index."""
    payload = msgspec.msgpack.encode(KVEventBatch(ts=float(step), events=collector.take()))
    for event in wire.decode_batch(payload).events:
        if isinstance(event, wire.BlockStored):
            blocks.store(event)
        elif isinstance(event, wire.BlockRemoved):
            blocks.remove(event)
