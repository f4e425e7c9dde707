"""A model whose every layer slides (Mistral-7B-v0.1's layout): one sliding-window KV cache group that gives
back the blocks leaving the window, as vLLM does, and the mask-only layout when the hybrid manager is off.

The tiny Mistral has three layers of window 8; with blocks of 4 tokens a window needs the two blocks before a
hit's end, and a request keeps at most three blocks plus the ones its step writes.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from prefixcache.config import EngineConfig
from prefixcache.core import FULL_ATTENTION, KVCacheGroupSpec
from prefixcache.engine import LLM, SamplingParams
from prefixcache.engine.core import EngineCore
from prefixcache.engine.messages import EngineCoreRequest
from prefixcache.model import LoadedModel, load_model
from tests.model.conftest import TINY_MODELS, VOCAB_SIZE, assert_matches_transformers

KIND = "mistral_window"
WINDOW = TINY_MODELS[KIND][1]["sliding_window"]
BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
rng = random.Random(3)
DOCUMENT = [rng.randrange(VOCAB_SIZE) for _ in range(30)]  # seven blocks and two tokens


@pytest.fixture(scope="module")
def mistral(checkpoint_dirs: dict[str, Path]) -> LoadedModel:
    loaded = load_model(checkpoint_dirs[KIND])
    assert loaded.config.layer_types == () and loaded.config.sliding_window == WINDOW  # every layer slides
    return loaded


def make_core(mistral: LoadedModel, **kwargs) -> EngineCore:
    config = EngineConfig(model=str(mistral.model_dir), block_size=BLOCK_SIZE, dtype="float32", **kwargs)
    return EngineCore(config, loaded=mistral)


def sharing(num_tokens: int) -> list[int]:
    """The first ``num_tokens`` of DOCUMENT, then tokens of its own (so the hit is at most those)."""
    own = random.Random(num_tokens)
    first = (DOCUMENT[num_tokens] + 1) % VOCAB_SIZE
    return [*DOCUMENT[:num_tokens], first, *(own.randrange(VOCAB_SIZE) for _ in range(5))]


def generate(llm: LLM, prompts: list[list[int]]) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def test_every_layer_in_one_sliding_group_unless_the_hybrid_manager_is_off(mistral):
    hybrid = make_core(mistral, num_blocks=16)
    assert hybrid.manager.groups == (KVCacheGroupSpec(WINDOW),)
    assert hybrid.manager.null_block.block_id == 0 and hybrid.manager.num_usable_blocks == 15
    mask_only = make_core(mistral, num_blocks=16, disable_hybrid_kv_cache_manager=True)
    assert mask_only.manager.groups == (FULL_ATTENTION,)
    assert mask_only.manager.null_block is None and mask_only.manager.num_usable_blocks == 16
    assert hybrid.block_bytes == mask_only.block_bytes  # one group of every layer either way
    for core in (hybrid, mask_only):
        core.close()


def test_blocks_leave_the_window_as_the_request_advances(mistral):
    core = make_core(mistral, num_blocks=40, max_num_batched_tokens=12)
    core.add_request(EngineCoreRequest("r", DOCUMENT, SamplingParams(max_tokens=3, ignore_eos=True)))
    tables = []
    for _ in range(4):
        core.step()
        tables.append(core.manager.block_ids(core.requests["r"]))
    assert tables == [
        [[1, 2, 3]],  # tokens 0..11
        [[0, 2, 3, 4, 5, 6]],  # 12..23 read from 5 on: block 0 (tokens 0..3) goes back
        [[0, 0, 0, 0, 5, 6, 7, 8]],  # 24..29 read from 17 on
        [[0, 0, 0, 0, 0, 6, 7, 8]],  # the first decode, at 30, reads from 23 on
    ]
    assert [block.block_id for block in core.manager.pool.evictable] == [1, 4, 3, 2, 5]  # cached, last first
    while core.has_unfinished_requests():
        core.step()
    assert [block.block_id for block in core.manager.pool.evictable] == [1, 4, 3, 2, 5, 6, 8, 7]
    core.manager.check_invariants()
    core.close()


def test_the_mask_only_layout_keeps_every_block(mistral):
    core = make_core(mistral, num_blocks=40, max_num_batched_tokens=12, disable_hybrid_kv_cache_manager=True)
    core.add_request(EngineCoreRequest("r", DOCUMENT, SamplingParams(max_tokens=3, ignore_eos=True)))
    for _ in range(4):
        core.step()
    assert core.manager.block_ids(core.requests["r"]) == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert len(core.manager.pool.evictable) == 0
    while core.has_unfinished_requests():
        core.step()
    core.close()


@pytest.mark.parametrize("hybrid", [True, False], ids=["sliding-group", "mask-only"])
def test_greedy_outputs_equal_transformers(mistral, hf_models, make_llm, hybrid):
    """Chunked prefill and decode over several windows, cold and with a hit, give transformers' tokens."""
    llm = make_llm(
        loaded=mistral, block_size=BLOCK_SIZE, num_blocks=64, max_num_batched_tokens=10,
        disable_hybrid_kv_cache_manager=not hybrid,
    )  # fmt: skip
    (cold,) = generate(llm, [DOCUMENT])
    assert cold.num_cached_tokens == 0
    (hit,) = generate(llm, [sharing(24)])
    assert hit.num_cached_tokens == 24
    for output in (cold, hit):
        assert_matches_transformers(output, hf_models[KIND])


def test_hits_need_only_the_window_before_their_end(mistral, make_llm):
    """A filler of 34 blocks, three more than the uncached free ones, evicts the oldest cached blocks: in the
    sliding group the document's blocks 4, 3 and 2 (ids 5, 4, 3), which left the window first; in the mask-only
    layout its last two (freed first when it finished). A hit needs only the two blocks before its end, so 28
    tokens still hit past the hole where the mask-only layout, needing every block from the first, hits 24;
    shorter prefixes whose window falls in the hole hit less than there."""
    filler = [random.Random(9).randrange(VOCAB_SIZE) for _ in range(130)]
    shared = [4, 12, 24, 28]
    expected = {False: [4, 8, 8, 28], True: [4, 12, 24, 24]}
    uncached = make_llm(loaded=mistral, block_size=BLOCK_SIZE, num_blocks=40, enable_prefix_caching=False)
    (alone,) = generate(uncached, [sharing(28)])
    for disable in (False, True):
        llm = make_llm(
            loaded=mistral, block_size=BLOCK_SIZE, num_blocks=40, max_num_seqs=1,
            disable_hybrid_kv_cache_manager=disable,
        )  # fmt: skip
        generate(llm, [DOCUMENT, filler])
        assert [llm.lookup({"prompt_token_ids": sharing(n)}).cached_tokens for n in shared] == expected[disable]
        (hit,) = generate(llm, [sharing(28)])
        assert hit.num_cached_tokens == expected[disable][-1]
        assert hit.outputs[0].token_ids == alone.outputs[0].token_ids
        for with_cache, without in zip(hit.outputs[0].logprobs, alone.outputs[0].logprobs, strict=True):
            assert with_cache == pytest.approx(without, abs=1e-5)
