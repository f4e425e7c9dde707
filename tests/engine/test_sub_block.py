"""Sub-block prefix caching end to end: copied K/V gives exactly the logits of a full recompute."""

import random

import pytest
import torch

from prefixcache.engine import LLM, SamplingParams
from prefixcache.model import load_model
from tests.helpers import assert_no_leaks, write_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def sampled_logits(llm: LLM, prompt: list[int], monkeypatch) -> tuple[torch.Tensor, list[int], int]:
    """First-token logits, generated tokens and cached tokens of one prompt."""
    captured = []
    model = llm.engine.core.runner.model
    compute = model.compute_logits

    def recording(hidden):
        logits = compute(hidden)
        captured.append(logits.clone())
        return logits

    monkeypatch.setattr(model, "compute_logits", recording)
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    monkeypatch.undo()
    return captured[0][0], out.outputs[0].token_ids, out.num_cached_tokens


def check_reuse(loaded, block_size, sub_block_size, cached_len, extra_len, expected_reuse, monkeypatch):
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(cached_len)]
    longer = shared + [rng.randrange(3, 500) for _ in range(extra_len)]
    common = dict(loaded=loaded, dtype="float32", block_size=block_size, num_blocks=8, max_num_batched_tokens=8192)
    reference = LLM(enable_prefix_caching=False, **common)
    ref_logits, ref_tokens, _ = sampled_logits(reference, longer, monkeypatch)
    llm = LLM(sub_block_size=sub_block_size, **common)
    llm.generate([{"prompt_token_ids": shared}], GREEDY, use_tqdm=False)
    logits, tokens, num_cached = sampled_logits(llm, longer, monkeypatch)
    assert num_cached == expected_reuse
    assert llm.stats().prefix_cache_copied_tokens == expected_reuse % block_size
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert_no_leaks(llm)


def test_block_256_sub_block_16(tiny_loaded, monkeypatch):
    # 200 cached tokens never fill a 256-token block: plain matching reuses 0, sub-blocks 192.
    check_reuse(tiny_loaded, 256, 16, cached_len=200, extra_len=60, expected_reuse=192, monkeypatch=monkeypatch)


def test_sub_block_hit_after_full_blocks(tiny_loaded, monkeypatch):
    check_reuse(tiny_loaded, 64, 16, cached_len=150, extra_len=30, expected_reuse=144, monkeypatch=monkeypatch)


@pytest.mark.slow
def test_block_4096_sub_block_128_reuses_2944_of_a_3000_token_prefix(tmp_path_factory, monkeypatch):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=8192)
    loaded = load_model(str(path), dtype="float32")
    check_reuse(loaded, 4096, 128, cached_len=3000, extra_len=500, expected_reuse=2944, monkeypatch=monkeypatch)
