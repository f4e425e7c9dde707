"""Pool changes become vLLM events: decoded with a consumer's own structs, not ours."""

import random

import msgspec
import pytest

from prefixcache.core import (
    KVCacheGroupSpec,
    KVCacheManager,
    MultiModalFeature,
    RetentionRange,
    longest_common_hit,
    root_hash,
)
from prefixcache.core.kv_cache_groups import RECURRENT_STATE, spec_of_kind
from prefixcache.core.miss import hittable_blocks
from prefixcache.core.state_table import CheckpointPolicy
from prefixcache.kv_events.collector import KVEventCollector
from prefixcache.kv_events.events import KVEventBatch, encode_block_hash
from prefixcache.offload import HostMemoryStore
from prefixcache.offload.connector import OffloadConnector, TierWriter
from prefixcache.offload.record import state_key
from tests.core.conftest import BLOCK_SIZE, admit, make_request, unique_tokens
from tests.kv_events import vllm_wire
from tests.offload.conftest import make_layout

HYBRID = (KVCacheGroupSpec(), KVCacheGroupSpec(sliding_window=8))


def make_manager(num_blocks: int = 10, **collector_args) -> tuple[KVCacheManager, KVEventCollector]:
    collector = KVEventCollector(**collector_args)
    manager = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, listeners=[collector])
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
        assert manager.allocate_slots(request, 0) is not None
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


# ---- several KV cache groups ------------------------------------------------------------------------


class GroupedBlockStored(vllm_wire.BlockStored, tag="BlockStored"):
    """vLLM's BlockStored with the group fields it carries (``group_idx``, the group's spec)."""

    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class GroupedBlockRemoved(vllm_wire.BlockRemoved, tag="BlockRemoved"):
    group_idx: int | None = None


class GroupedBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[GroupedBlockStored | GroupedBlockRemoved | vllm_wire.AllBlocksCleared]
    data_parallel_rank: int | None = None


class GroupAwareConsumer:
    """What a router keeps of a hybrid backend from its events alone: each group's spec and held hashes."""

    def __init__(self) -> None:
        self.specs: dict[int, KVCacheGroupSpec] = {}
        self.held: dict[int, set] = {}

    def feed(self, payload: bytes) -> None:
        for event in msgspec.msgpack.decode(payload, type=GroupedBatch).events:
            if isinstance(event, GroupedBlockStored):
                assert event.kv_cache_spec_kind == ("full_attention", "sliding_window", "mamba")[event.group_idx]
                spec = spec_of_kind(event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window)
                self.specs[event.group_idx] = spec
                self.held.setdefault(event.group_idx, set()).update(event.block_hashes)
            elif isinstance(event, GroupedBlockRemoved):
                self.held[event.group_idx].difference_update(event.block_hashes)
            else:
                self.held.clear()

    @staticmethod
    def _holds(held: set):
        return lambda block_hash: True if block_hash in held else None

    def predicted_hit(self, request) -> int:
        hashes = [
            encode_block_hash(h, "uint64")
            for h in request.hash_blocks("sha256", root_hash("sha256"), 0, request.num_tokens // BLOCK_SIZE, BLOCK_SIZE)
        ]
        if not self.specs:  # no event yet: it holds nothing
            return 0
        groups = [self.specs[g] for g in sorted(self.specs)]
        lookups = [self._holds(self.held.get(g, set())) for g in sorted(self.specs)]
        k, _ = longest_common_hit(groups, lookups, hashes, hittable_blocks(request.num_tokens, BLOCK_SIZE), BLOCK_SIZE)
        return k * BLOCK_SIZE


def test_each_group_has_its_events_with_its_spec_as_vllm_sends_them():
    collector = KVEventCollector(groups=HYBRID)
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE, groups=HYBRID, listeners=[collector])
    request = make_request(unique_tokens(12, 0))
    manager.allocate_slots(request, 12)
    hashes = [encode_block_hash(h, "uint64") for h in manager.block_hashes(request)]
    stored = msgspec.msgpack.decode(wire(collector), type=GroupedBatch).events
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window, e.block_hashes) for e in stored] == [
        (0, "full_attention", None, hashes),
        (1, "sliding_window", 8, hashes),
    ]
    assert all(e.token_ids == unique_tokens(12, 0) for e in stored)
    filler = make_request(unique_tokens(7 * BLOCK_SIZE, 100))
    manager.free(request)
    manager.allocate_slots(filler, filler.num_tokens)  # 14 blocks: the 13 never used, then the first freed
    events = msgspec.msgpack.decode(wire(collector), type=GroupedBatch).events
    removed = [(e.group_idx, e.block_hashes) for e in events if isinstance(e, GroupedBlockRemoved)]
    assert removed == [(0, hashes[2:3])]  # freed position by position, last first: the full group's block 2


@pytest.mark.parametrize(
    "groups, state",
    [
        (HYBRID, {}),
        # Recurrent state too: its checkpoints are blocks of the third group (vLLM's mamba kind), evicted from 3
        # slots, sparse every 2 blocks.
        (
            (*HYBRID, RECURRENT_STATE),
            {"num_state_slots": 8, "num_checkpoint_slots": 3, "checkpoint_policy": CheckpointPolicy(2)},
        ),
    ],
    ids=["attention", "with-state"],
)
def test_a_consumer_of_a_hybrid_backends_events_predicts_every_hit_exactly(groups, state):
    """A random mix of chunked prefills, decodes and frees on a small pool (evictions in every group)."""
    rng = random.Random(7)
    collector = KVEventCollector(groups=groups)
    manager = KVCacheManager(num_blocks=31, block_size=BLOCK_SIZE, groups=groups, listeners=[collector], **state)
    consumer = GroupAwareConsumer()
    prefixes = [[rng.randrange(50) for _ in range(n)] for n in (9, 20, 26)]
    running = []
    checked = 0
    for _ in range(300):
        if running and rng.random() < 0.4:
            request = running.pop(rng.randrange(len(running)))
            manager.free(request)
        elif running and rng.random() < 0.6:
            request = rng.choice(running)
            if request.num_computed_tokens == request.num_tokens:
                request.append_output_token_ids([rng.randrange(50)])
            num = min(rng.randrange(1, 9), request.num_tokens - request.num_computed_tokens)
            manager.allocate_slots(request, num)
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            request = make_request(tokens)
            hit = manager.find_prefix(request)
            chunk = min(rng.randrange(1, 16), request.num_tokens - hit.num_tokens)
            if manager.allocate_slots(request, chunk, hit) is not None:
                running.append(request)
        manager.take_transfers()  # the step ran: its checkpoints can be hit, and the engine publishes now
        consumer.feed(wire(collector))
        for prefix in prefixes:
            for extra in (1, 4):
                probe = make_request(prefix + [7] * extra)
                assert consumer.predicted_hit(probe) == manager.lookup(probe.prompt_token_ids).cached_tokens
                checked += consumer.predicted_hit(probe) > 0
    assert checked > 100  # the hits were not all zero


def test_stored_blocks_carry_their_retention_last_and_vllms_decoder_still_reads_them():
    manager, collector = make_manager()
    retention = [RetentionRange(0, 4, priority=90, ttl_s=600), RetentionRange(4, 8, priority=10, ttl_s=30)]
    admit(manager, make_request(unique_tokens(13, 0), retention=retention))
    payload = wire(collector)
    raw = msgspec.msgpack.decode(payload)[1][0]
    assert list(raw)[-1] == "retention"
    assert raw["retention"] == [[90, 600.0], [10, 30.0], [35, None]]
    [event] = vllm_wire.decoder.decode(payload).events
    assert isinstance(event, vllm_wire.BlockStored) and len(event.block_hashes) == 3
    admit(manager, make_request(unique_tokens(9, 100)))  # no directive: the field is left out
    assert "retention" not in msgspec.msgpack.decode(wire(collector))[1][0]


def test_a_tiers_checkpoints_are_the_state_groups_events_with_its_medium_and_vllms_decoder_reads_them():
    """A host tier on full attention and recurrent state: its blocks are announced for the attention group, its
    checkpoints (records under their state keys) for the state group under their blocks' hashes, as the device's
    checkpoints are; vLLM's structs decode them, with and without the group fields."""
    layout = make_layout(block_size=BLOCK_SIZE, state_bytes=8)
    collector = KVEventCollector(groups=(KVCacheGroupSpec(), RECURRENT_STATE))
    stores = [HostMemoryStore(layout, 4 * layout.block_bytes)]
    connector = OffloadConnector(
        stores, BLOCK_SIZE, writer=TierWriter(stores, background=False), tier_listeners=[collector]
    )
    first, second = bytes([1]) * 32, bytes([2]) * 32
    connector.writer.submit([0], [(first, bytes(layout.block_bytes)), (second, bytes(layout.block_bytes))])
    connector.writer.submit([0], [(state_key(second), bytes(8))])
    connector.take_plan(lambda block_hash: None)  # the step delivers the tier's events
    stores[0].discard([state_key(second), first])  # one change of a block and a checkpoint
    connector.take_plan(lambda block_hash: None)
    payload = wire(collector)
    events = msgspec.msgpack.decode(payload, type=GroupedBatch).events
    uint64 = vllm_wire.as_uint64
    assert [
        (type(e).__name__, e.medium, e.group_idx, getattr(e, "kv_cache_spec_kind", None), e.block_hashes)
        for e in events
    ] == [
        ("GroupedBlockStored", "CPU", 0, "full_attention", [uint64(first), uint64(second)]),
        ("GroupedBlockStored", "CPU", 1, "mamba", [uint64(second)]),
        ("GroupedBlockRemoved", "CPU", 0, None, [uint64(first)]),
        ("GroupedBlockRemoved", "CPU", 1, None, [uint64(second)]),
    ]
    stored = [e for e in events if isinstance(e, GroupedBlockStored)]
    assert all(e.token_ids == [] and e.parent_block_hash is None and e.block_size == BLOCK_SIZE for e in stored)
    plain = vllm_wire.decoder.decode(payload).events  # a consumer without the group fields still reads them
    assert [(type(e).__name__, e.medium) for e in plain] == [(type(e).__name__[7:], e.medium) for e in events]
