"""The real Gemma 3 270M (PyPI's Q4_K_M GGUF of google/gemma-3-270m) through the engine, in float32: llama.cpp's
greedy tokens on the same file, and prefix hits across its six KV cache groups (five sliding groups of window
512, one full) with the outputs of the cache off."""

from __future__ import annotations

import pytest

from prefixcache.core import FULL_ATTENTION, KVCacheGroupSpec
from prefixcache.engine import SamplingParams
from tests.helpers import REAL_MODEL_MAX_TOKENS, REAL_MODEL_PROMPTS, assert_greedy_agrees

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
WINDOW = 512
SLIDING = KVCacheGroupSpec(WINDOW)
# Longer than the window (about 750 tokens), so the sliding groups give their first blocks back.
DOCUMENT = " ".join(f"Fact {i}: {i} times {i} is {i * i}." for i in range(1, 42))
QUESTIONS = ("What is 7 times 7?", "What is 12 times 12?", "Which fact comes after fact 30?")


@pytest.fixture
def make_gemma(gemma3_270m, make_llm):
    return lambda **kwargs: make_llm(loaded=gemma3_270m, block_size=BLOCK_SIZE, num_blocks=800, **kwargs)


def test_the_gguf_loads_as_gemma_3_270m(gemma3_270m):
    """What transformers takes from its defaults, missing from the GGUF (the attention scale, the local RoPE base,
    every sixth layer full), is what google/gemma-3-270m has."""
    config = gemma3_270m.config
    assert (config.architecture, config.num_layers, config.hidden_size, config.vocab_size) == (
        "Gemma3ForCausalLM", 18, 640, 262144,
    )  # fmt: skip
    assert (config.query_pre_attn_scalar, config.rope_theta, config.sliding_rope_theta) == (256, 1e6, 1e4)
    assert [(group.sliding_window, group.layers) for group in config.kv_cache_groups()] == [
        (WINDOW, (0, 1, 2)),
        (WINDOW, (3, 4, 6)),
        (None, (5, 11, 17)),
        (WINDOW, (7, 8, 9)),
        (WINDOW, (10, 12, 13)),
        (WINDOW, (14, 15, 16)),
    ]
    assert gemma3_270m.tokenizer.bos_token_id == 2


def test_greedy_tokens_equal_llamacpps_on_the_same_gguf(gemma3_270m, llamacpp_gemma3_270m, make_gemma):
    tokenizer = gemma3_270m.tokenizer
    for text, ref in zip(REAL_MODEL_PROMPTS, llamacpp_gemma3_270m, strict=True):
        assert tokenizer(text).input_ids == ref.prompt_ids  # split as llama.cpp splits it, BOS first
        assert ref.prompt_ids[0] == tokenizer.bos_token_id
    params = SamplingParams(max_tokens=REAL_MODEL_MAX_TOKENS, temperature=0.0, logprobs=2)
    outputs = make_gemma().generate(
        [{"prompt_token_ids": ref.prompt_ids} for ref in llamacpp_gemma3_270m], params, use_tqdm=False
    )
    compared = [
        assert_greedy_agrees(output.outputs[0].token_ids, output.outputs[0].logprobs, ref)
        for output, ref in zip(outputs, llamacpp_gemma3_270m, strict=True)
    ]
    assert sum(compared) >= len(compared) * REAL_MODEL_MAX_TOKENS // 2, f"near-ties came early: {compared}"


def test_prefix_hits_across_the_six_groups_keep_the_outputs_of_the_cache_off(gemma3_270m, make_gemma):
    tokenizer = gemma3_270m.tokenizer
    prompts = [tokenizer(f"{DOCUMENT}\nQuestion: {question} Answer:").input_ids for question in QUESTIONS]
    shared = next(i for i, ids in enumerate(zip(*prompts, strict=False)) if len(set(ids)) > 1)
    assert shared > WINDOW + 3 * BLOCK_SIZE
    hit = shared // BLOCK_SIZE * BLOCK_SIZE
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)

    llm = make_gemma()
    assert llm.engine.core.manager.groups == (SLIDING, SLIDING, FULL_ATTENTION, SLIDING, SLIDING, SLIDING)
    first = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert llm.lookup({"prompt_token_ids": prompts[1]}).cached_tokens == hit

    # Admitted with the hit, a sliding group holds only the blocks its window reaches; the full group all.
    engine = llm.engine
    request_id = engine.add_request({"prompt_token_ids": prompts[1]}, params)
    engine.step()
    tables = engine.core.manager.block_ids(engine.core.requests[request_id])
    outside = (hit - WINDOW + 1) // BLOCK_SIZE
    null = engine.core.manager.null_block.block_id
    for spec, table in zip(engine.core.manager.groups, tables, strict=True):
        full = spec == FULL_ATTENTION
        assert null not in (table if full else table[outside:])
        assert full or table[:outside] == [null] * outside
    outputs = [first]
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    outputs += llm.generate([{"prompt_token_ids": prompts[2]}], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [0, hit, hit]

    alone = make_gemma(enable_prefix_caching=False).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    for with_cache, without in zip(outputs, alone, strict=True):
        assert with_cache.outputs[0].token_ids == without.outputs[0].token_ids
        for ours, theirs in zip(with_cache.outputs[0].logprobs, without.outputs[0].logprobs, strict=True):
            assert ours == pytest.approx(theirs, abs=1e-3)
