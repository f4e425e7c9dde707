"""The engine's layout of its KV cache memory, from a model's config alone (what ``explain`` replays through):
blocks, working states and checkpoints of a Qwen3.5 shape, to the byte, and the settings' errors."""

import pytest

from prefixcache.config import EngineConfig
from prefixcache.core import FULL_ATTENTION
from prefixcache.core.kv_cache_groups import RECURRENT_STATE
from prefixcache.engine.cache_layout import cache_layout
from prefixcache.model.config import GatedDeltaNetSpec, ModelConfig

# tests/model/conftest.py's tiny Qwen3.5: three Gated DeltaNet layers, then full attention with 2 KV heads of 16.
QWEN35 = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=1024,
    architecture="Qwen3_5ForCausalLM",
    layer_types=("gated_delta_net",) * 3 + ("full_attention",),
    gated_delta_net=GatedDeltaNetSpec(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=12, conv_kernel=4),
)
LLAMA = ModelConfig(512, 64, 2, 4, 2, 16, 128, 1e-6, 10000.0, 1024)


def test_a_qwen35_shape_gets_its_checkpoints_working_states_and_blocks_to_the_byte():
    layout = cache_layout(EngineConfig(block_size=16, kv_cache_memory="1200KiB", dtype="float32"), QWEN35)
    assert layout.groups == (FULL_ATTENTION, RECURRENT_STATE)
    # Per GDN layer: the conv window (3 x (2 * 2 * 8 + 4 * 12) = 3 x 80 values) and a 4 x 8 x 12 matrix state.
    assert layout.state_slot_bytes == 3 * (3 * 80 + 4 * 8 * 12) * 4 == 7488
    assert layout.block_bytes == 16 * 2 * 2 * 16 * 4  # one attention layer's K and V
    assert (layout.num_state_slots, layout.num_checkpoint_slots) == (64, 1200 * 1024 // 4 // 7488) == (64, 41)
    assert layout.num_blocks == (1200 * 1024 - 105 * 7488) // 4096 == 108
    # 1,024 positions are 64 blocks, over half of the 41 slots: every 4 blocks, but never closer than 256 tokens.
    assert layout.checkpoint_policy(16).sparse_every_blocks == 16
    bfloat16 = cache_layout(EngineConfig(block_size=16, kv_cache_memory="1200KiB", dtype="bfloat16"), QWEN35)
    assert bfloat16.state_slot_bytes == 3 * (3 * 80 * 2 + 4 * 8 * 12 * 4)  # matrix states stay float32


def test_no_caching_keeps_no_checkpoints_and_an_attention_model_no_states():
    off = cache_layout(EngineConfig(kv_cache_memory="1200KiB", dtype="float32", enable_prefix_caching=False), QWEN35)
    assert (off.num_checkpoint_slots, off.num_state_slots, off.enable_caching) == (0, 64, False)
    llama = cache_layout(EngineConfig(kv_cache_memory="1MiB", dtype="float32", num_blocks=7), LLAMA)
    assert (llama.groups, llama.num_blocks, llama.state_bytes) == ((FULL_ATTENTION,), 7, 0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kv_cache_memory": "400KiB"}, "2 KV blocks of 4,096 bytes each beside 576,576 bytes of recurrent states"),
        ({"max_model_len": 2048}, "longer than the 1,024 positions"),
    ],
)
def test_a_layout_that_cannot_work_names_the_setting(settings, message):
    with pytest.raises(ValueError, match=message):
        cache_layout(EngineConfig(dtype="float32", **settings), QWEN35)
