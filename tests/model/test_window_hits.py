"""Sliding-window models through the engine: prefix-cache hits that end inside, at and past a window boundary
give transformers' greedy tokens and log-probabilities, the same as without the cache (float32)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from prefixcache.engine import LLM, SamplingParams
from prefixcache.model import LoadedModel, load_model
from tests.helpers import assert_no_leaks
from tests.model.conftest import TINY_MODELS, VOCAB_SIZE, assert_matches_transformers

BLOCK_SIZE = 16
KINDS = ["qwen3_window", "gemma3"]
WINDOW = TINY_MODELS["gemma3"][1]["sliding_window"]  # two blocks
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
rng = random.Random(0)
DOCUMENT = [rng.randrange(VOCAB_SIZE) for _ in range(5 * BLOCK_SIZE)]


@pytest.fixture(scope="module")
def loaded(checkpoint_dirs: dict[str, Path]) -> dict[str, LoadedModel]:
    models = {kind: load_model(checkpoint_dirs[kind]) for kind in KINDS}
    assert {m.config.sliding_window for m in models.values()} == {WINDOW}
    return models


def prompt_sharing(num_tokens: int) -> list[int]:
    """The first ``num_tokens`` of DOCUMENT, then a suffix that leaves it at once (so the hit is exactly those)."""
    suffix_rng = random.Random(num_tokens)
    first = (DOCUMENT[num_tokens] + 1) % VOCAB_SIZE
    return [*DOCUMENT[:num_tokens], first, *(suffix_rng.randrange(VOCAB_SIZE) for _ in range(9))]


def generate(llm: LLM, prompt: list[int]) -> Any:
    return llm.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)[0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "hit_tokens",
    [BLOCK_SIZE, WINDOW, WINDOW + BLOCK_SIZE, 4 * BLOCK_SIZE],
    ids=["inside-window", "at-window", "past-window", "two-blocks-past"],
)
def test_hits_across_the_window_boundary_match_transformers(
    kind: str, hit_tokens: int, loaded, hf_models, make_llm
) -> None:
    model = loaded[kind]
    cached = make_llm(loaded=model, block_size=BLOCK_SIZE, num_blocks=32)
    uncached = make_llm(loaded=model, block_size=BLOCK_SIZE, num_blocks=32, enable_prefix_caching=False)
    document = generate(cached, DOCUMENT)  # cold
    assert document.num_cached_tokens == 0
    assert_matches_transformers(document, hf_models[kind])

    prompt = prompt_sharing(hit_tokens)
    hit = generate(cached, prompt)
    assert hit.num_cached_tokens == hit_tokens
    assert_matches_transformers(hit, hf_models[kind])
    alone = generate(uncached, prompt)
    assert alone.num_cached_tokens == 0
    assert alone.outputs[0].token_ids == hit.outputs[0].token_ids
    for with_cache, without in zip(hit.outputs[0].logprobs, alone.outputs[0].logprobs, strict=True):
        assert with_cache == pytest.approx(without, abs=1e-5)
    for llm in (cached, uncached):
        assert_no_leaks(llm)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_over_the_window_matches_transformers(kind: str, loaded, hf_models, make_llm) -> None:
    """Prefill chunks of 20 tokens: chunk starts fall inside, at and past window boundaries."""
    model = loaded[kind]
    llm = make_llm(loaded=model, block_size=BLOCK_SIZE, num_blocks=32, max_num_batched_tokens=20)
    assert_matches_transformers(generate(llm, DOCUMENT), hf_models[kind])
    assert_no_leaks(llm)
