"""Retention directives through the offline API: a retained prefix survives a flood, outputs do not change, and
each request's output says how many prompt tokens it wrote into and read from retained blocks."""

import random

import pytest

from prefixcache.core import RetentionRange
from prefixcache.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
rng = random.Random(25)
PREFIX = [rng.randrange(3, 500) for _ in range(18)]
FLOOD = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(6)]


def generate(llm, prompts, **kwargs):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, **kwargs)


@pytest.mark.parametrize("retain", [False, True])
def test_a_retained_prefix_survives_a_flood_that_evicts_it_under_lru(make_llm, retain):
    llm = make_llm(num_blocks=24)  # 96 tokens: each flood prompt takes 11 of the 24 blocks
    retention = [RetentionRange(0, 16, priority=90, ttl_s=600)] if retain else []
    first = generate(llm, [PREFIX + [7]], retention=retention)[0]
    assert first.num_retained_written_tokens == (16 if retain else 0)
    for prompt in FLOOD:
        generate(llm, [prompt])
    again = generate(llm, [PREFIX + [8]])[0]
    assert again.num_cached_tokens == (16 if retain else 0)
    assert (again.num_retained_read_tokens, again.num_retained_written_tokens) == ((16, 0) if retain else (0, 0))
    assert (
        again.outputs[0].token_ids
        == generate(make_llm(enable_prefix_caching=False), [PREFIX + [8]])[0].outputs[0].token_ids
    )
    stats = llm.stats()
    assert stats.retained_blocks_by_tenant == ({"": 4} if retain else {})
    assert stats.prefix_cache_retained_read_tokens == (16 if retain else 0)
    assert stats.kv_cache_block_hits["retained"] == (4 if retain else 0)
    assert stats.kv_cache_block_evictions["default"] > 0


def test_one_retention_list_per_prompt_and_the_clamp_is_reported(make_llm):
    llm = make_llm(max_retention_ttl_s=10.0)
    outputs = generate(
        llm,
        [PREFIX + [1], FLOOD[0]],
        retention=[[RetentionRange(0, 8, priority=80, ttl_s=3600)], [RetentionRange(0, 4, priority=80)]],
    )
    assert [o.num_retained_written_tokens for o in outputs] == [8, 4]
    assert [o.retention_clamped for o in outputs] == ["max_retention_ttl_s", None]


def test_bad_retention_is_refused_before_anything_runs(make_llm):
    llm = make_llm()
    with pytest.raises(ValueError, match="2 retention lists for 1 prompts"):
        generate(llm, [PREFIX], retention=[[RetentionRange(0, 4)], [RetentionRange(0, 4)]])
    with pytest.raises(ValueError, match="is past the prompt of 18 tokens"):
        generate(llm, [PREFIX, PREFIX + [1, 2, 3]], retention=[RetentionRange(0, 20, priority=80)])
    assert not llm.engine.has_unfinished_requests()
