"""Pool changes become vLLM events: decoded with a consumer's own structs, not ours."""

import msgspec

from prefixcache.core import KVCacheManager, MultiModalFeature
from prefixcache.kv_events.collector import KVEventCollector
from prefixcache.kv_events.events import KVEventBatch
from tests.core.conftest import BLOCK_SIZE, admit, make_request, unique_tokens
from tests.kv_events import vllm_wire


def make_manager(num_blocks: int = 10, **collector_args) -> tuple[KVCacheManager, KVEventCollector]:
    manager = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE)
    collector = KVEventCollector(**collector_args)
    manager.pool.add_listener(collector)
    return manager, collector


def wire(collector: KVEventCollector) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(ts=1.5, events=collector.take(), data_parallel_rank=0))


def decode(collector: KVEventCollector) -> list:
    batch = vllm_wire.decoder.decode(wire(collector))
    assert (batch.ts, batch.data_parallel_rank) == (1.5, 0)
    return batch.events


def removals(collector: KVEventCollector) -> list:
    return [e for e in decode(collector) if isinstance(e, vllm_wire.BlockRemoved)]


def test_the_batch_is_an_array_and_each_event_a_map_tagged_by_class_name():
    manager, collector = make_manager()
    admit(manager, make_request(unique_tokens(9, 0)))
    ts, [event], rank = msgspec.msgpack.decode(wire(collector))
    assert (ts, rank) == (1.5, 0)
    assert event["type"] == "BlockStored"
    assert list(event)[:9] == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    ]
    assert event["group_idx"] == 0
    assert event["kv_cache_spec_kind"] == "full_attention"
    assert "kv_cache_spec_sliding_window" not in event  # defaults are omitted, as vLLM omits them


def test_stored_blocks_carry_hashes_as_vllms_uint64_tokens_and_parent():
    manager, collector = make_manager()
    first = make_request(unique_tokens(9, 0))
    admit(manager, first)
    second = make_request(unique_tokens(8, 0) + unique_tokens(4, 100))
    admit(manager, second)
    one, two = decode(collector)
    hashes = manager.block_hashes(second)
    assert isinstance(one, vllm_wire.BlockStored)
    assert one.block_hashes == [vllm_wire.as_uint64(h) for h in hashes[:2]]
    assert one.parent_block_hash is None
    assert one.token_ids == unique_tokens(8, 0)
    assert (one.block_size, one.medium, one.lora_id, one.lora_name) == (BLOCK_SIZE, "GPU", None, None)
    assert one.extra_keys == [None, None]
    assert two.block_hashes == [vllm_wire.as_uint64(hashes[2])]
    assert two.parent_block_hash == vllm_wire.as_uint64(hashes[1])
    assert two.token_ids == unique_tokens(4, 100)


def test_the_bytes_encoding_sends_whole_digests():
    manager, collector = make_manager(block_hash_encoding="bytes")
    request = make_request(unique_tokens(12, 0))
    admit(manager, request)
    [event] = decode(collector)
    hashes = manager.block_hashes(request)
    assert event.block_hashes == [bytes(h) for h in hashes[:3]]
    assert all(len(h) == 32 for h in event.block_hashes)


def test_extra_keys_take_vllms_order_and_shape_without_the_salt():
    manager, collector = make_manager()
    request = make_request(
        unique_tokens(12, 0),
        cache_salt="tenant-a",
        lora_name="sql",
        mm_features=[MultiModalFeature("img-1", offset=2, length=4)],
    )
    admit(manager, request)
    payload = wire(collector)
    [event] = vllm_wire.decoder.decode(payload).events
    assert event.lora_name == "sql"
    assert event.lora_id is None
    # msgpack has no tuples: the (identifier, offset) pairs come back as arrays, as from vLLM.
    assert event.extra_keys == [("sql", ["img-1", 2]), ("sql", ["img-1", -2]), ("sql",)]
    # vLLM would send the salt with the first block: it names a tenant, so only the hashes it went into leave
    assert b"tenant-a" not in payload
    assert event.block_hashes == [vllm_wire.as_uint64(h) for h in manager.block_hashes(request)[:3]]


def test_a_salt_alone_leaves_no_extra_keys_and_token_ids_may_be_left_out():
    manager, collector = make_manager(token_ids=False)
    request = make_request(unique_tokens(8, 0), cache_salt="secret-salt")
    admit(manager, request)
    payload = wire(collector)
    [event] = vllm_wire.decoder.decode(payload).events
    assert (event.extra_keys, event.token_ids) == ([None, None], [])
    assert event.block_hashes == [vllm_wire.as_uint64(h) for h in manager.block_hashes(request)]
    assert b"secret-salt" not in payload


def test_removal_is_reported_only_when_the_last_copy_of_a_hash_goes():
    manager, collector = make_manager(num_blocks=4)
    a, b = make_request(unique_tokens(5, 0)), make_request(unique_tokens(5, 0))
    for request in (a, b):  # both admitted before either is cached: two copies of block 0
        assert manager.allocate_slots(request, 0, 0, []) is not None
    for request in (a, b):
        manager.allocate_slots(request, request.num_tokens)
    manager.free(a)
    manager.free(b)
    [stored] = decode(collector)
    assert isinstance(stored, vllm_wire.BlockStored)
    filler = make_request(unique_tokens(4 * BLOCK_SIZE, 1000))
    manager.allocate_slots(filler, 3 * BLOCK_SIZE)  # two uncached blocks and one copy of block 0
    assert removals(collector) == []
    manager.allocate_slots(filler, BLOCK_SIZE)
    [removed] = removals(collector)
    assert isinstance(removed, vllm_wire.BlockRemoved)
    assert removed.block_hashes == stored.block_hashes
    assert removed.medium == "GPU"


def test_reset_is_all_blocks_cleared_after_what_came_before():
    manager, collector = make_manager()
    request = make_request(unique_tokens(8, 0))
    admit(manager, request)
    manager.free(request)
    assert manager.reset_prefix_cache()
    kinds = [type(e) for e in decode(collector)]
    assert kinds == [vllm_wire.BlockStored, vllm_wire.AllBlocksCleared]


def test_an_offload_tier_names_its_medium():
    manager, collector = make_manager(num_blocks=3, medium="CPU")
    first = make_request(unique_tokens(8, 0))
    admit(manager, first)
    manager.free(first)
    admit(manager, make_request(unique_tokens(12, 100)))
    stored, removed = decode(collector)[:2]
    assert (stored.medium, removed.medium) == ("CPU", "CPU")


def test_take_hands_over_the_events_once():
    manager, collector = make_manager()
    admit(manager, make_request(unique_tokens(4, 0)))
    assert len(collector.take()) == 1
    assert collector.take() == []
