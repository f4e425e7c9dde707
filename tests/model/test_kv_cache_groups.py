"""KV cache groups on the model side: which layers share a page, the cache tensors laid out by slot, and
sliding-window layers that gather only the blocks of their window (the blocks before it may be gone)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixcache.model import AttentionMetadata, DecoderForCausalLM, KVCacheGroup, ModelConfig, load_model
from tests.model.conftest import PagedRunner
from tests.model.test_decoder import assert_matches, random_tokens, run_mixed_batch
from tests.model.test_loader import hf_like_config

SLIDING, FULL = "sliding_attention", "full_attention"


def config_with(layer_types: list[str] | None, architecture: str = "Qwen2ForCausalLM", window: int = 64) -> ModelConfig:
    hf = hf_like_config(
        architectures=[architecture],
        num_hidden_layers=len(layer_types) if layer_types else 4,
        use_sliding_window=True,
        sliding_window=window,
        layer_types=layer_types,
        query_pre_attn_scalar=8,
    )
    return ModelConfig.from_hf_config(hf)


def layout(groups: tuple[KVCacheGroup, ...]) -> list[tuple[int | None, list[int]]]:
    return [(group.sliding_window, list(group.layers)) for group in groups]


def test_gemma3_five_sliding_per_full_layer_gives_groups_of_one() -> None:
    config = config_with([SLIDING] * 5 + [FULL], "Gemma3ForCausalLM", window=1024)
    assert layout(config.kv_cache_groups()) == [(1024, [i]) for i in range(5)] + [(None, [5])]
    assert layout(config.kv_cache_groups(hybrid=False)) == [(None, [0, 1, 2, 3, 4, 5])]


def test_gemma3_1b_shape_pads_the_last_sliding_group() -> None:
    """26 layers, every sixth full: 4 full and 22 sliding layers in pages of 4 (the last sliding group has 2)."""
    config = config_with([FULL if (i + 1) % 6 == 0 else SLIDING for i in range(26)], "Gemma3ForCausalLM", 512)
    groups = config.kv_cache_groups()
    assert layout(groups) == [
        (512, [0, 1, 2, 3]),
        (512, [4, 6, 7, 8]),
        (None, [5, 11, 17, 23]),
        (512, [9, 10, 12, 13]),
        (512, [14, 15, 16, 18]),
        (512, [19, 20, 21, 22]),
        (512, [24, 25]),
    ]


@pytest.mark.parametrize(
    ("layer_types", "expected"),
    [
        ([FULL, FULL, SLIDING, SLIDING], [(None, [0, 1]), (64, [2, 3])]),
        # As many of one kind as of the other, nearly: one page of the larger count, the smaller one padded.
        ([FULL] * 4 + [SLIDING] * 3, [(None, [0, 1, 2, 3]), (64, [4, 5, 6])]),
        ([FULL] * 3 + [SLIDING] * 2, [(None, [0, 1]), (None, [2]), (64, [3, 4])]),
        ([SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING], [(64, [0, 2]), (None, [1, 4]), (64, [3, 5])]),
    ],
)
def test_groups_have_equal_sizes(layer_types: list[str], expected: list) -> None:
    assert layout(config_with(layer_types).kv_cache_groups()) == expected


def test_one_attention_spec_is_one_group() -> None:
    llama = ModelConfig.from_hf_config(hf_like_config())
    assert layout(llama.kv_cache_groups()) == [(None, [0, 1, 2, 3])]
    mistral = ModelConfig.from_hf_config(hf_like_config(architectures=["MistralForCausalLM"], sliding_window=16))
    assert layout(mistral.kv_cache_groups()) == [(16, [0, 1, 2, 3])]
    assert layout(mistral.kv_cache_groups(hybrid=False)) == [(None, [0, 1, 2, 3])]


@pytest.mark.parametrize(("window", "layers"), [(None, ()), (0, (0,)), (None, (1, 0)), (None, (0, 0)), (None, (-1,))])
def test_bad_groups_are_refused(window: int | None, layers: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        KVCacheGroup(window, layers)


@pytest.fixture(scope="module")
def gemma(checkpoint_dirs: dict[str, Path]) -> DecoderForCausalLM:
    return load_model(checkpoint_dirs["gemma3"]).model


def test_slots_share_storage_across_groups(gemma: DecoderForCausalLM) -> None:
    groups = gemma.config.kv_cache_groups()
    assert layout(groups) == [(32, [0, 1]), (None, [2, 5]), (32, [3, 4])]
    caches = gemma.allocate_kv_cache(10, 16, torch.float32, "cpu", groups)
    assert len(caches) == 6
    assert caches[0] is caches[2] is caches[3] and caches[1] is caches[5] is caches[4] and caches[0] is not caches[1]
    assert caches[0][0] is not caches[0][1] and caches[0][0].shape == (10, 16, 2, 16)
    mask_only = gemma.allocate_kv_cache(10, 16, torch.float32, "cpu")
    assert len({id(k) for k, _ in mask_only}) == 6
    per_layer_block = 2 * 16 * 2 * 16 * 4  # K and V, 16 tokens, 2 heads of 16, float32
    assert gemma.kv_bytes_per_block(16, groups=groups) == 2 * per_layer_block
    assert gemma.kv_bytes_per_block(16) == 6 * per_layer_block


@pytest.mark.parametrize(
    "groups",
    [
        (KVCacheGroup(None, (0, 1, 2, 3, 4)),),
        (KVCacheGroup(None, (0, 1, 2)), KVCacheGroup(32, (2, 3, 4, 5))),
    ],
)
def test_groups_must_hold_every_layer_once(gemma: DecoderForCausalLM, groups) -> None:
    with pytest.raises(ValueError, match="each of the 6 layers once"):
        gemma.allocate_kv_cache(4, 16, torch.float32, "cpu", groups)


def test_forward_needs_metadata_for_each_group_of_a_layout(gemma: DecoderForCausalLM) -> None:
    groups = gemma.config.kv_cache_groups()
    caches = gemma.allocate_kv_cache(4, 16, torch.float32, "cpu", groups)
    ids = torch.tensor([1, 2, 3])
    meta = AttentionMetadata.build([[1]], [0], [3], 16, "cpu")
    with pytest.raises(ValueError, match=r"one attention metadata per KV cache group \(1 or 3 of them\), got 2"):
        gemma(ids, meta.positions, caches, [meta, meta])
    windowed = AttentionMetadata.build([[1]], [0], [3], 16, "cpu", sliding_window=32)
    with pytest.raises(ValueError, match=r"group 1 has layers of windows \[None\]; .* gathers a window of 32"):
        gemma(ids, meta.positions, caches, [windowed, windowed, windowed])


def test_windowed_metadata_starts_each_gather_at_the_first_visible_block() -> None:
    """Window 10, blocks of 4: after 13 tokens the first visible key is 13 - 10 + 1 = 4, in block 1, so block 0
    (id 7) is never gathered; a request that sees everything starts at block 0 and is padded by clipping."""
    tables = [[7, 0, 9, 2, 5], [4, 6]]
    meta = AttentionMetadata.build(tables, [13, 5], [2, 1], 4, "cpu", sliding_window=10)
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 6 * 4 + 1]
    assert meta.sliding_window == 10
    (group,) = meta.groups
    assert group.block_tables.tolist() == [[0, 9, 2], [4, 6, 0]]
    assert group.kv_start is not None and group.kv_start.tolist() == [4, 0]
    assert group.kv_len == 12 and group.max_reach == 14 - 4
    mask = group.mask(10, torch.float32)[:, 0, 0]  # each request's first query: positions 13 and 5
    visible = [[int(k) for k in torch.nonzero(row == 0).flatten()] for row in mask]
    assert visible == [list(range(10)), list(range(6))]  # keys 4..13 of request 0, 0..5 of request 1


def test_a_long_fresh_prompt_is_attended_in_windowed_chunks() -> None:
    """With a window, a fresh prompt is split into 512-query chunks, each reading only its window's blocks."""
    meta = AttentionMetadata.build([list(range(80))], [0], [1200], 16, "cpu", sliding_window=100)
    assert sorted((g.token_slice, g.max_q, g.kv_len, g.fresh) for g in meta.groups) == [
        ((0, 512), 512, 512, True),
        ((512, 1024), 512, (64 - 25) * 16, False),  # keys from position 413 (block 25) to 1023
        ((1024, 1200), 176, (75 - 57) * 16, False),  # keys from 925 (block 57) to 1199
    ]
    full = AttentionMetadata.build([list(range(80))], [0], [1200], 16, "cpu")
    assert len(full.groups) == 1 and full.groups[0].fresh


def test_a_window_longer_than_the_context_needs_no_window_mask() -> None:
    meta = AttentionMetadata.build([[3, 4]], [0], [20], 16, "cpu", sliding_window=32)
    assert meta.groups[0].mask(32, torch.float32) is None  # plain causal: SDPA's fastest path


def runners(model: DecoderForCausalLM, block_size: int, num_blocks: int = 160) -> tuple[PagedRunner, PagedRunner]:
    """The mask-only layout, and the hybrid one freeing (for reuse) the blocks that leave the windows."""
    hybrid = PagedRunner(model, block_size, num_blocks, groups=model.config.kv_cache_groups(), free_out_of_window=True)
    return PagedRunner(model, block_size, num_blocks), hybrid


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_window"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_hybrid_layout_with_freed_blocks_matches_the_mask_only_layout(
    kind: str, block_size: int, checkpoint_dirs, hf_models
) -> None:
    """Prefill chunks and decodes past the window: the tables hold the null block (NaN) before the window and
    the freed blocks are written again by the other groups."""
    model = load_model(checkpoint_dirs[kind]).model
    tokens = random_tokens(111, seed=7)
    mask_only, hybrid = runners(model, block_size)
    outs: dict[str, list[torch.Tensor]] = {"mask": [], "hybrid": []}
    pos = 0
    for size in (40, 7, 33, 1, 1, 20, 1, 1, 1, 5, 1):
        for name, runner in (("mask", mask_only), ("hybrid", hybrid)):
            outs[name].append(runner.step([("a", tokens[pos : pos + size])])["a"])
        pos += size
    assert hybrid.num_freed, "no block left the window"
    for table, group in zip(hybrid.tables["a"], hybrid.groups, strict=True):
        assert (PagedRunner.NULL_BLOCK in table) == (group.sliding_window is not None)
    torch.testing.assert_close(torch.cat(outs["hybrid"]), torch.cat(outs["mask"]), atol=1e-4, rtol=1e-4)
    assert_matches(torch.cat(outs["hybrid"]), hf_models[kind], tokens[:pos], 0)


def test_sliding_groups_gather_only_their_window(gemma: DecoderForCausalLM) -> None:
    """A decode at position 300 with a window of 32 in blocks of 16 reads keys 269..300, in blocks 16 to 18;
    the full group reads all 19 blocks."""
    _, hybrid = runners(gemma, 16, num_blocks=80)
    tokens = random_tokens(301, seed=8)
    hybrid.step([("a", tokens[:300])])
    hybrid.step([("a", tokens[300:])])
    widths = [[tuple(g.block_tables.shape) for g in meta.groups] for meta in hybrid.last_metadata]
    assert widths == [[(1, 3)], [(1, 19)], [(1, 3)]]


@pytest.mark.parametrize("hit_blocks", [1, 2, 3, 5], ids=["inside", "at", "past", "far-past"])
def test_prefix_shared_in_the_hybrid_layout(hit_blocks: int, gemma: DecoderForCausalLM, hf_models) -> None:
    """A second request starts on the first blocks of the first (a prefix hit ending inside, at and past the
    window of 32 tokens), whose sliding tables have null blocks before the window by then."""
    block_size = 16
    prefix = random_tokens(hit_blocks * block_size, seed=9)
    first = [*prefix, *random_tokens(30, seed=10)]
    second = [*prefix, *random_tokens(25, seed=11)]
    mask_only, hybrid = runners(gemma, block_size)
    results = {}
    for name, runner in (("mask", mask_only), ("hybrid", hybrid)):
        runner.step([("a", first)])
        runner.share_prefix("a", "b", num_blocks=hit_blocks)
        results[name] = torch.cat([runner.step([("b", second[len(prefix) : -1])])["b"]])
        results[name] = torch.cat([results[name], runner.step([("b", second[-1:]), ("a", [3])])["b"]])
    torch.testing.assert_close(results["hybrid"], results["mask"], atol=1e-4, rtol=1e-4)
    assert_matches(results["hybrid"], hf_models["gemma3"], second, len(prefix))


def test_mixed_batch_in_the_hybrid_layout(gemma: DecoderForCausalLM, hf_models) -> None:
    """Prefill chunks, decodes and a prefix filled in the same step, each request at its own window offset."""
    run_mixed_batch(gemma, hf_models["gemma3"], groups=gemma.config.kv_cache_groups(), free_out_of_window=True)
