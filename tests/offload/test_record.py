"""Records: a block reads back only for the exact layout and hash it was written for, intact, and with a
deployment secret only if it was written with that secret."""

import dataclasses

import pytest

from prefixcache.offload.record import (
    BadRecord,
    RecordError,
    RecordKey,
    RecordRetention,
    decode_record,
    encode_record,
    record_retention,
    state_key,
)
from tests.offload.conftest import SECRET, block_hash, forger, keyed_layout, make_layout, payload


def test_round_trip_gives_the_exact_payload(layout):
    data = payload(layout, 7)
    assert decode_record(layout, block_hash(7), encode_record(layout, block_hash(7), data)) == data


@pytest.mark.parametrize(
    "change",
    [
        {"model_fingerprint": "other-model"},
        {"dtype": "bfloat16"},
        {"block_size": 8},
        {"hash_algo": "xxhash"},
        {"root_hash": b"\x02" * 32},
        {"num_layers": 3},
    ],
)
def test_any_change_that_invalidates_kv_gives_another_namespace_and_a_foreign_record(layout, change):
    other = make_layout(**change)
    assert other.namespace != layout.namespace
    record = encode_record(other, block_hash(1), payload(other, 1))
    bad = decode_record(layout, block_hash(1), record)
    assert isinstance(bad, BadRecord) and bad.reason is RecordError.FOREIGN


def test_same_layout_gives_the_same_namespace_in_every_process():
    assert make_layout().namespace == make_layout().namespace
    assert len(make_layout().namespace) == 16


def test_record_of_another_block_is_foreign(layout):
    record = encode_record(layout, block_hash(1), payload(layout, 1))
    assert decode_record(layout, block_hash(2), record).reason is RecordError.FOREIGN


@pytest.mark.parametrize("keep", [0, 10, 40, -1])
def test_truncated_record_is_a_miss(layout, keep):
    record = encode_record(layout, block_hash(1), payload(layout, 1))
    bad = decode_record(layout, block_hash(1), record[:keep] if keep >= 0 else record[:-1])
    assert isinstance(bad, BadRecord) and bad.reason is RecordError.TRUNCATED


@pytest.mark.parametrize("position", [-1, -100, 60])
def test_flipped_bit_is_a_miss(layout, position):
    record = bytearray(encode_record(layout, block_hash(1), payload(layout, 1)))
    record[position] ^= 0x01
    bad = decode_record(layout, block_hash(1), bytes(record))
    assert isinstance(bad, BadRecord) and bad.reason is RecordError.CORRUPT


def test_garbage_is_foreign(layout):
    assert decode_record(layout, block_hash(1), b"x" * 200).reason is RecordError.FOREIGN


def test_payload_of_the_wrong_size_is_refused(layout):
    with pytest.raises(ValueError, match="payload has"):
        encode_record(layout, block_hash(1), b"short")


def test_layout_validates_its_fields():
    with pytest.raises(ValueError, match="dtype"):
        make_layout(dtype="int8")
    with pytest.raises(ValueError, match="positive"):
        make_layout(block_size=0)
    assert make_layout().block_bytes == 2 * 2 * 4 * 2 * 4 * 4


def test_keyed_round_trip_gives_the_exact_payload():
    layout = keyed_layout()
    data = payload(layout, 7)
    assert decode_record(layout, block_hash(7), encode_record(layout, block_hash(7), data)) == data


@pytest.mark.parametrize("forger_secret", [None, b"a guessed secret of some length"], ids=["checksummed", "other-key"])
def test_a_forged_record_is_refused_with_a_secret(forger_secret):
    layout = keyed_layout()
    forged = encode_record(forger(layout, forger_secret), block_hash(1), payload(layout, 2))
    bad = decode_record(layout, block_hash(1), forged)
    assert isinstance(bad, BadRecord) and bad.reason is RecordError.FORGED


def test_without_a_secret_a_well_formed_record_is_trusted(layout):
    """What the tiers trust without a secret: anyone who writes a well-formed record (as the README says)."""
    forged = encode_record(forger(layout, None), block_hash(1), payload(layout, 2))
    assert decode_record(layout, block_hash(1), forged) == payload(layout, 2)


@pytest.mark.parametrize("position", [-1, -100])
def test_an_altered_keyed_record_is_refused(position):
    layout = keyed_layout()
    record = bytearray(encode_record(layout, block_hash(1), payload(layout, 1)))
    record[position] ^= 0x01
    assert decode_record(layout, block_hash(1), bytes(record)).reason is RecordError.FORGED


def test_the_secret_is_part_of_the_namespace_and_never_shown(layout):
    keyed, other = keyed_layout(), make_layout(record_key=RecordKey(b"another secret, 16+ bytes"))
    assert len({layout.namespace, keyed.namespace, other.namespace}) == 3
    assert keyed.namespace == keyed_layout().namespace
    assert SECRET.decode() not in repr(keyed) + str(keyed.describe())
    assert keyed.describe()["record_mac"] == f"hmac-sha256 key {keyed.record_key.key_id}"
    # a record from a keyed store read without the secret, in the same namespace: never trusted
    record = encode_record(keyed, block_hash(1), payload(keyed, 1))
    assert decode_record(forger(keyed, None), block_hash(1), record).reason is RecordError.FOREIGN


def test_a_short_secret_is_refused():
    with pytest.raises(ValueError, match="at least 16"):
        RecordKey(b"short")


@pytest.mark.parametrize("keyed", [False, True], ids=["checksum", "mac"])
def test_a_retained_record_names_its_retention_inside_the_check(keyed):
    layout = keyed_layout() if keyed else make_layout()
    data, kept = payload(layout, 3), RecordRetention(90, 1_800_000_000.5)
    plain = encode_record(layout, block_hash(3), data)
    record = encode_record(layout, block_hash(3), data, kept)
    assert (plain[4], record[4]) == (layout.record_version, layout.record_version | 0x80)
    assert len(record) == len(plain) + 9 and record_retention(plain) is None
    assert record_retention(record) == kept
    assert decode_record(layout, block_hash(3), record) == data
    extended = bytearray(record)
    extended[4 + 1 + 16 + 1 + 32 + 8] ^= 0x01  # the last byte of the expiry: someone keeping it longer
    bad = decode_record(layout, block_hash(3), bytes(extended))
    assert isinstance(bad, BadRecord) and bad.reason is (RecordError.FORGED if keyed else RecordError.CORRUPT)


def test_a_checkpoint_reads_back_under_its_blocks_state_key_and_nowhere_else():
    """A model with recurrent layers stores each checkpoint under its block's state key, with the layout's state
    size; a block record where a checkpoint belongs (or the reverse) is foreign, as is a checkpoint of a model whose
    states have another size."""
    layout = make_layout(state_bytes=40)
    key = state_key(block_hash(1))
    state = bytes(range(40))
    record = encode_record(layout, key, state)
    assert decode_record(layout, key, record) == state
    assert decode_record(layout, block_hash(1), record).reason is RecordError.FOREIGN
    block_record = encode_record(layout, block_hash(1), payload(layout, 1))
    assert decode_record(layout, key, block_record).reason is RecordError.FOREIGN
    other = make_layout(state_bytes=48)
    assert other.namespace != layout.namespace
    assert decode_record(other, key, encode_record(other, key, bytes(48))) == bytes(48)
    assert decode_record(layout, key, encode_record(other, key, bytes(48))).reason is RecordError.FOREIGN
    with pytest.raises(ValueError, match="payload has 39 bytes"):
        encode_record(layout, key, state[:-1])


def test_an_attention_only_layout_keeps_its_namespace_and_stores_no_checkpoints(layout):
    assert "state_bytes" not in layout.describe()  # the namespace digests what it did before checkpoints existed
    with pytest.raises(ValueError, match="no recurrent state"):
        encode_record(layout, state_key(block_hash(1)), b"")
    with_states = dataclasses.replace(layout, state_bytes=8)  # a checkpoint written into this namespace
    object.__setattr__(with_states, "namespace", layout.namespace)
    record = encode_record(with_states, state_key(block_hash(1)), bytes(8))
    assert decode_record(layout, state_key(block_hash(1)), record).reason is RecordError.FOREIGN
