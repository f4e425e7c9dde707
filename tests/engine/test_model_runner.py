"""The model runner on a hybrid KV cache layout: one block table per group, built here by hand (null blocks
before the window in the sliding groups), gives the mask-only layout's tokens and log-probabilities."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from prefixcache.engine.model_runner import ModelRunner
from prefixcache.engine.request import EngineRequest
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.scheduler import ScheduledChunk, SchedulerOutput
from prefixcache.model import load_model
from tests.helpers import write_tiny_checkpoint

BLOCK_SIZE = 16
NULL_BLOCK = 0  # never in a table's window, so never written: its K/V stay zero


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    folder = tmp_path_factory.mktemp("gemma3")
    path = write_tiny_checkpoint(folder, "gemma3_text", num_hidden_layers=6, layer_types=layer_types, sliding_window=32)
    return load_model(path).model


def run(runner: ModelRunner, tables: Callable[[int], list], steps: int = 4) -> tuple[list[int], list[dict]]:
    """A 70-token prompt, then decodes; ``tables(position)`` gives the chunk's block_ids at each step start."""
    params = SamplingParams(max_tokens=steps, temperature=0.0, logprobs=2)
    request = EngineRequest(request_id="r", prompt_token_ids=list(range(3, 73)), sampling_params=params)
    tokens, logprobs, start = [], [], 0
    for _ in range(steps):
        num_new = request.num_tokens - start
        out = runner.execute(SchedulerOutput(chunks=[ScheduledChunk(request, start, num_new, tables(start))]))
        tokens.append(out.sampled["r"])
        logprobs.append(out.logprobs["r"])
        request.append_output_token_ids([out.sampled["r"]])
        start += num_new
    return tokens, logprobs


def test_per_group_tables_with_null_blocks_match_the_mask_only_layout(gemma) -> None:
    groups = gemma.config.kv_cache_groups()
    assert [g.sliding_window for g in groups] == [32, None, 32]
    hybrid = ModelRunner(gemma, 64, BLOCK_SIZE, torch.float32, "cpu", seed=0, kv_cache_groups=groups)
    mask_only = ModelRunner(gemma, 64, BLOCK_SIZE, torch.float32, "cpu", seed=0)
    blocks = [[1 + 6 * g + i for i in range(6)] for g in range(len(groups))]

    def hybrid_tables(start: int) -> list[list[int]]:
        """Each group's own blocks; a sliding group's blocks wholly before start - 32 + 1 are the null block."""
        first_kept = max(start - 32 + 1, 0) // BLOCK_SIZE
        return [
            [NULL_BLOCK] * first_kept + table[first_kept:] if group.sliding_window else table
            for group, table in zip(groups, blocks, strict=True)
        ]

    assert hybrid_tables(70)[0][:2] == [NULL_BLOCK, NULL_BLOCK]
    tokens, logprobs = run(hybrid, hybrid_tables)
    expected_tokens, expected_logprobs = run(mask_only, lambda start: blocks[0])  # one table: today's scheduler
    assert tokens == expected_tokens
    for got, expected in zip(logprobs, expected_logprobs, strict=True):
        assert got == pytest.approx(expected, abs=1e-5)


def test_a_chunk_needs_a_table_for_each_group(gemma) -> None:
    groups = gemma.config.kv_cache_groups()
    runner = ModelRunner(gemma, 16, BLOCK_SIZE, torch.float32, "cpu", seed=0, kv_cache_groups=groups)
    request = EngineRequest(request_id="r", prompt_token_ids=[5, 6, 7])
    with pytest.raises(ValueError, match="a chunk has 1 block tables for 3 KV cache groups"):
        runner.execute(SchedulerOutput(chunks=[ScheduledChunk(request, 0, 3, [[2]])]))
