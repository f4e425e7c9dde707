"""The router's index: which backend holds which hash, per medium, and the longest held prefix."""

import random

from prefixcache.core import KVCacheManager, Request
from prefixcache.router.index import IndexListener, PrefixIndex
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


def test_a_listener_on_real_pools_predicts_every_lookup_exactly():
    """Prompts over shared prefixes through two small caches with eviction: prediction == the manager's hit."""
    rng = random.Random(3)
    index = PrefixIndex()
    managers = {}
    for name in ("a", "b"):
        managers[name] = KVCacheManager(num_blocks=24, block_size=4, listeners=[IndexListener(index, name)])
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
    for name, manager in managers.items():
        assert index.num_blocks(name) == len(manager.pool.cached[0])
    managers["a"].reset_prefix_cache()
    assert index.num_blocks("a") == 0 and index.num_blocks("b") == len(managers["b"].pool.cached[0])
