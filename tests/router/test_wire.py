"""KV event batches decoded from bytes laid out as vLLM publishes them (plain msgpack values, not our classes)."""

import msgspec
import pytest

from prefixcache.router.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    decode_seq,
    external_block_hash,
)


def test_a_batch_is_an_array_of_ts_events_and_rank_with_events_tagged_by_class_name():
    payload = msgspec.msgpack.encode(
        [
            12.5,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [2**64 - 1, 7],
                    "parent_block_hash": None,
                    "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
                    "block_size": 4,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [[["salt", "t1"]], None],
                    "group_idx": 1,
                    "kv_cache_spec_kind": "sliding_window",
                    "kv_cache_spec_sliding_window": 128,
                    "locality": "LOCAL",  # newer vLLM fields are ignored
                },
                {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"},
                {"type": "AllBlocksCleared"},
            ],
            0,
        ]
    )
    batch = decode_batch(payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [2**64 - 1, 7]
    assert stored.extra_keys == [[["salt", "t1"]], None] and stored.medium == "GPU"
    assert (stored.group_idx, stored.kv_cache_spec_kind, stored.kv_cache_spec_sliding_window) == (
        1,
        "sliding_window",
        128,
    )
    assert isinstance(removed, BlockRemoved) and removed.medium == "CPU"
    assert removed.group_idx is None  # a publisher without groups: group 0
    assert isinstance(cleared, AllBlocksCleared)


def test_rank_may_be_left_out_and_hashes_may_be_bytes():
    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": None}]])
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert external_block_hash(batch.events[0].block_hashes[0]) == int.from_bytes(b"\x01" * 8, "big")


def test_the_integer_form_is_the_last_eight_digest_bytes_big_endian():
    digest = bytes(range(32))
    assert external_block_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert external_block_hash(2**64 + 5) == 5


@pytest.mark.parametrize(
    "value",
    [
        {"ts": 1.0, "events": []},  # a map, not vLLM's array
        [1.0, [{"type": "BlockEvicted", "block_hashes": [1]}]],  # unknown tag
        [1.0, [{"type": "BlockStored"}]],  # required field missing
        "not a batch",
    ],
)
def test_payloads_in_another_shape_are_refused(value):
    with pytest.raises(ValueError):
        decode_batch(msgspec.msgpack.encode(value))


def test_sequence_frames_are_signed_eight_byte_big_endian():
    assert decode_seq((5).to_bytes(8, "big")) == 5
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == -1
    with pytest.raises(ValueError):
        decode_seq(b"\x00\x01")
