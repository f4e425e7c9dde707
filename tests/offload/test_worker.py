"""The worker side: blocks between the KV cache tensors and bytes, each layer from (or to) its group's block;
state checkpoints between state slots and bytes."""

import pytest
import torch

from prefixcache.offload import HostMemoryStore
from prefixcache.offload.connector import BlockSave, OffloadPlan, StateLoad, StateSave, TierWriter
from prefixcache.offload.record import state_key
from prefixcache.offload.worker import (
    OffloadWorker,
    read_blocks,
    read_states,
    state_slot_bytes,
    write_blocks,
    write_states,
)
from tests.offload.conftest import block_hash, make_layout

SHAPE = (8, 4, 2, 3)  # blocks, block size, KV heads, head dim


def kv_caches(num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every value names its layer, K or V, block and slot, so a copy from the wrong block shows."""
    caches = []
    for layer in range(num_layers):
        base = torch.arange(8 * 4 * 2 * 3, dtype=torch.float32).view(SHAPE)
        caches.append((base + 1000 * layer, base + 1000 * layer + 500))
    return caches


def test_a_payload_reads_each_layer_from_the_block_of_its_group_and_writes_it_back_there():
    layer_groups = [0, 1, 0]  # layers 0 and 2 in group 0, layer 1 in group 1
    source = kv_caches(3)
    [payload] = read_blocks(source, [(2, 5)], layer_groups)
    target = [(torch.zeros(SHAPE), torch.zeros(SHAPE)) for _ in range(3)]
    write_blocks(target, [(6, 1)], [payload], layer_groups)
    for layer, group_block in ((0, (2, 6)), (1, (5, 1)), (2, (2, 6))):
        read, written = group_block
        for kv in (0, 1):
            assert torch.equal(target[layer][kv][written], source[layer][kv][read])
    assert float(target[1][0][6].abs().sum()) == 0.0  # layer 1 goes to group 1's block only


def test_a_group_without_a_block_is_left_alone():
    layer_groups = [0, 1]
    source = kv_caches(2)
    payloads = read_blocks(source, [(3, 4), (5, 6)], layer_groups)
    target = [(torch.zeros(SHAPE), torch.zeros(SHAPE)) for _ in range(2)]
    write_blocks(target, [(1, None), (2, 7)], payloads, layer_groups)  # row 0 is outside group 1's window
    assert torch.equal(target[0][0][1], source[0][0][3]) and torch.equal(target[0][0][2], source[0][0][5])
    assert torch.equal(target[1][1][7], source[1][1][6])
    assert all(float(target[1][kv][:7].abs().sum()) == 0.0 for kv in (0, 1))  # nothing else in layer 1


def test_saved_blocks_reach_the_tier_with_their_retention():
    """A retained block the worker copies out outlives a default one in the host tier."""
    layout = make_layout(block_size=4, num_layers=1, num_kv_heads=2, head_dim=3)
    host = HostMemoryStore(layout, 2 * layout.block_bytes)
    worker = OffloadWorker(kv_caches(1), layout, TierWriter([host], background=False))
    kept, plain, newer = block_hash(1), block_hash(2), block_hash(3)
    worker.after_forward(
        OffloadPlan(save_after=[BlockSave((2,), kept, (0,), (90, 60.0)), BlockSave((3,), plain, (0,))])
    )
    worker.after_forward(OffloadPlan(save_after=[BlockSave((4,), newer, (0,))]))
    assert [h in host for h in (kept, plain, newer)] == [True, False, True]


def state_cache(num_slots: int) -> list[tuple[torch.Tensor, ...]]:
    """Two recurrent layers as the model lays them out: a bfloat16 conv window, then (the first) a float32 matrix
    state; every value names its layer, tensor and slot."""
    conv = [torch.arange(num_slots * 6, dtype=torch.bfloat16).view(num_slots, 3, 2) + 100 * i for i in range(2)]
    matrix = torch.arange(num_slots * 8, dtype=torch.float32).view(num_slots, 2, 4) + 0.5
    return [(conv[0], matrix), (conv[1],)]


def test_a_checkpoint_payload_is_every_recurrent_layers_state_of_one_slot_in_their_dtypes():
    source = state_cache(4)
    payloads = read_states(source, [2, 0])
    assert [len(p) for p in payloads] == [state_slot_bytes(source)] * 2 == [6 * 2 + 8 * 4 + 6 * 2] * 2
    target = [tuple(torch.zeros_like(t) for t in tensors) for tensors in source]
    write_states(target, [3, 1], payloads)
    for tensors, written in zip(source, target, strict=True):
        for tensor, copy in zip(tensors, written, strict=True):
            assert torch.equal(copy[3], tensor[2]) and torch.equal(copy[1], tensor[0])
            assert not copy[0].any() and not copy[2].any()  # the other slots are left alone


def test_saved_checkpoints_reach_the_tier_under_their_key_and_loads_fill_working_slots():
    layout = make_layout(num_layers=1, head_dim=3, state_bytes=state_slot_bytes(state_cache(1)))
    host = HostMemoryStore(layout, 10 * layout.block_bytes)
    states = state_cache(4)
    worker = OffloadWorker(kv_caches(1), layout, TierWriter([host], background=False), None, states)
    key = state_key(block_hash(1))
    worker.after_forward(OffloadPlan(state_save_after=[StateSave(3, key, (0,))]))
    [payload] = host.load_prefix([key])
    assert payload == read_states(states, [3])[0]
    worker.before_forward(OffloadPlan(state_loads=[StateLoad(0, key, payload, 0)]))
    assert all(torch.equal(tensor[0], tensor[3]) for tensors in states for tensor in tensors)


def test_a_state_cache_of_another_size_than_the_layouts_checkpoints_is_refused():
    layout = make_layout(num_layers=1, head_dim=3, state_bytes=state_slot_bytes(state_cache(1)) + 4)
    writer = TierWriter([HostMemoryStore(layout, 10 * layout.block_bytes)], background=False)
    with pytest.raises(ValueError, match="a state slot takes 56 bytes, the layout's checkpoints 60"):
        OffloadWorker(kv_caches(1), layout, writer, None, state_cache(4))
