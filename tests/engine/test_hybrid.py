"""The engine on a hybrid model: a tiny Gemma 3 (two layers of window 32 per full-attention layer, six layers,
so three KV cache groups: sliding, full, sliding) with blocks of 16 tokens, the window two blocks.

Every feature of the cache must work through the groups: chunked prefill, preemption, salts and LoRA keys,
both eviction policies, the lookup, the offload tiers; and give the outputs of the cache off and of the
mask-only layout (``disable_hybrid_kv_cache_manager``), in float32.
"""

from __future__ import annotations

import logging
import random

import pytest

from prefixcache.config import EngineConfig
from prefixcache.core import KVCacheGroupSpec
from prefixcache.engine import LLM, SamplingParams
from prefixcache.engine.core import EngineCore
from prefixcache.engine.messages import EngineCoreRequest
from prefixcache.model import load_model
from tests.helpers import assert_no_leaks, write_tiny_checkpoint

BLOCK_SIZE = 16
WINDOW = 32
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
rng = random.Random(11)
DOCUMENT = [rng.randrange(3, 500) for _ in range(100)]  # six blocks and four tokens


def prompts() -> list[list[int]]:
    """Questions after the shared document, some sharing more of it than others, and exact repeats."""
    out = []
    for i in range(10):
        shared = DOCUMENT[: (40, 64, 100)[i % 3]]
        out.append(shared + [rng.randrange(3, 500) for _ in range(3 + i)])
    return out + out[:3]


PROMPTS = prompts()


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    path = write_tiny_checkpoint(
        tmp_path_factory.mktemp("gemma3"), "gemma3_text", num_hidden_layers=6, layer_types=layer_types,
        sliding_window=WINDOW,
    )  # fmt: skip
    return load_model(path)


@pytest.fixture
def make_llm(gemma):
    built: list[LLM] = []

    def make(**kwargs) -> LLM:
        kwargs.setdefault("num_blocks", 200)
        llm = LLM(str(gemma.model_dir), loaded=gemma, block_size=BLOCK_SIZE, dtype="float32", **kwargs)
        built.append(llm)
        return llm

    yield make
    for llm in built:
        assert_no_leaks(llm)
        llm.engine.core.close()


def run(llm: LLM, batch: list[list[int]] = PROMPTS) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(gemma) -> list[list[int]]:
    """Greedy tokens with the cache off, each layer keeping every block (the mask-only layout)."""
    llm = LLM(
        str(gemma.model_dir), loaded=gemma, block_size=BLOCK_SIZE, num_blocks=200, enable_prefix_caching=False,
        disable_hybrid_kv_cache_manager=True, dtype="float32",
    )  # fmt: skip
    return token_ids(run(llm))


def make_core(gemma, **kwargs) -> EngineCore:
    config = EngineConfig(model=str(gemma.model_dir), block_size=BLOCK_SIZE, num_blocks=100, dtype="float32", **kwargs)
    return EngineCore(config, loaded=gemma)


def test_the_engine_groups_the_layers_as_the_model_does(make_llm):
    core = make_llm().engine.core
    assert core.manager.groups == (KVCacheGroupSpec(WINDOW), KVCacheGroupSpec(), KVCacheGroupSpec(WINDOW))
    assert core.manager.null_block.block_id == 0
    mask_only = make_llm(disable_hybrid_kv_cache_manager=True).engine.core
    assert mask_only.manager.groups == (KVCacheGroupSpec(),) and mask_only.manager.null_block is None
    # A block of the hybrid pool spans one group's two layers, the mask-only one all six.
    hybrid_block, mask_block = (
        c.loaded.model.kv_bytes_per_block(BLOCK_SIZE, None, c.loaded.config.kv_cache_groups(hybrid=h))
        for c, h in ((core, True), (mask_only, False))
    )
    assert mask_block == 3 * hybrid_block


def test_sliding_groups_keep_only_their_window_while_a_request_runs(gemma):
    core = make_core(gemma, max_num_batched_tokens=48)
    core.add_request(EngineCoreRequest("r", DOCUMENT, SamplingParams(max_tokens=4, ignore_eos=True)))
    core.step()  # tokens 0..47: three blocks in each group, group by group
    assert core.manager.block_ids(core.requests["r"]) == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    core.step()  # 48..95: their queries read from 17 on, so block 0 (0..15) goes back to the free queue
    assert core.manager.block_ids(core.requests["r"]) == [
        [0, 2, 3, 10, 11, 12],
        [4, 5, 6, 13, 14, 15],
        [0, 8, 9, 16, 17, 18],
    ]
    core.step()  # 96..99 read from 65 on: blocks 1..3 leave too
    assert core.manager.block_ids(core.requests["r"]) == [
        [0, 0, 0, 0, 11, 12, 19],
        [4, 5, 6, 13, 14, 15, 20],
        [0, 0, 0, 0, 17, 18, 21],
    ]
    assert [block.block_id for block in core.manager.pool.evictable] == [1, 7, 10, 3, 2, 16, 9, 8]  # last first
    while core.has_unfinished_requests():
        core.step()
    core.close()


def test_chunked_prefill_and_preemption_give_the_outputs_of_the_cache_off(make_llm, reference):
    llm = make_llm(num_blocks=40, max_num_batched_tokens=24, max_num_seqs=8)
    outputs = run(llm)
    assert token_ids(outputs) == reference
    stats = llm.stats()
    assert stats.num_preemptions > 0, "the pool was meant to be too small for every request at once"
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_preempted_hits > 0


def test_hits_and_outputs_equal_the_mask_only_layouts_when_both_hold_everything(make_llm, reference):
    hybrid, mask_only = make_llm(), make_llm(disable_hybrid_kv_cache_manager=True)
    hybrid_out, mask_out = run(hybrid), run(mask_only)
    assert token_ids(hybrid_out) == token_ids(mask_out) == reference
    assert [o.num_cached_tokens for o in hybrid_out] == [o.num_cached_tokens for o in mask_out]
    assert hybrid.stats().prefix_cache_hit_rate == mask_only.stats().prefix_cache_hit_rate > 0.3


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_each_eviction_policy_keeps_outputs_under_memory_pressure(make_llm, reference, policy):
    llm = make_llm(num_blocks=48, max_num_seqs=2, eviction_policy=policy)
    outputs = run(llm)
    assert token_ids(outputs) == reference
    assert llm.stats().prefix_cache_hits > 0


def test_the_lookup_finds_what_admission_then_reuses(make_llm):
    llm = make_llm()
    run(llm, [DOCUMENT + [7]])
    for shared in (16, 31, 32, 47, 64, 100):  # hits ending inside, at and past a window boundary
        prompt = DOCUMENT[:shared] + [1, 2, 3]
        expected = llm.lookup({"prompt_token_ids": prompt}).cached_tokens
        assert expected == shared // BLOCK_SIZE * BLOCK_SIZE
        assert run(llm, [prompt])[0].num_cached_tokens == expected


def test_salts_and_lora_names_keep_their_blocks_apart(gemma):
    core = make_core(gemma)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    core.add_request(EngineCoreRequest("a", DOCUMENT, params, cache_salt="tenant-a", lora_name="adapter"))
    while core.has_unfinished_requests():
        core.step()
    assert core.lookup(DOCUMENT, cache_salt="tenant-a", lora_name="adapter").cached_tokens == 96
    assert core.lookup(DOCUMENT, cache_salt="tenant-b", lora_name="adapter").cached_tokens == 0
    assert core.lookup(DOCUMENT, cache_salt="tenant-a").cached_tokens == 0
    assert core.lookup(DOCUMENT).cached_tokens == 0
    core.close()


def test_the_host_tier_holds_every_groups_layers(make_llm, reference, caplog):
    """Records are written through and loaded into every group that needs them, outputs unchanged."""
    with caplog.at_level(logging.WARNING, logger="prefixcache.offload.engine"):
        llm = make_llm(num_blocks=30, max_num_seqs=1, kv_offload_cpu="64MiB")
    assert "write-through" in caplog.text
    first = run(llm, PROMPTS[:3])
    fillers = [[rng.randrange(3, 500) for _ in range(120)] for _ in range(2)]  # 8 blocks a group each
    run(llm, fillers)  # evict the document's blocks from the device
    llm.engine.core.offload.writer.flush()
    assert llm.lookup({"prompt_token_ids": PROMPTS[2]}).cached_tokens_by_tier["CPU"] > 0
    again = run(llm, PROMPTS[:3])
    assert token_ids(first) == token_ids(again) == reference[:3]
    (host,) = llm.stats().kv_offload
    assert host.hit_tokens > 0, "nothing came back from the host tier"


def test_sub_blocks_are_refused_for_a_hybrid_model_at_start_up(make_llm):
    with pytest.raises(ValueError, match="disable the hybrid KV cache manager"):
        make_llm(sub_block_size=8)
    assert make_llm(sub_block_size=8, disable_hybrid_kv_cache_manager=True).engine.core.manager.sub_blocks
