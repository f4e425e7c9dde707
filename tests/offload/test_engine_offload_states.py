"""The engine with offload tiers on a model with recurrent layers (the tiny Qwen3.5: three Gated DeltaNet layers,
then full attention; float32, blocks of 16 tokens): a prefix whose blocks and state checkpoint left the device hits
from the host tier, and from the disk or Redis tier in the next engine, with the greedy tokens and
log-probabilities of a run without any cache."""

import math
import random

import pytest

from prefixcache.core import Request
from prefixcache.engine import LLM, SamplingParams
from tests.engine.test_recurrent_state import qwen35  # noqa: F401 (the module's tiny Qwen3.5, a fixture)

BLOCK_SIZE = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
rng = random.Random(11)
DOCUMENT = [rng.randrange(3, 500) for _ in range(100)]  # 6 blocks and 4 tokens: its frontier checkpoint at 96
SECOND = DOCUMENT[:96] + [7, 8, 9]  # parts where the first request's checkpoint lies
FILLERS = [[rng.randrange(3, 500) for _ in range(100)] for _ in range(3)]


@pytest.fixture
def make_llm(make_llm, qwen35):  # noqa: F811
    """The shared factory (leak check, close) on the tiny Qwen3.5: 12 blocks, and 2 checkpoint slots in 60 KiB (a
    state is 7,488 bytes), so that three other prompts push the first one's blocks and checkpoint out."""

    def make(**kwargs) -> LLM:
        kwargs.setdefault("num_blocks", 12)
        kwargs.setdefault("kv_cache_memory", "60KiB")
        return make_llm(loaded=qwen35, block_size=BLOCK_SIZE, max_num_batched_tokens=40, **kwargs)

    return make


def generate(llm: LLM, prompt: list[int]):
    return llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]


@pytest.fixture
def cold(make_llm):
    """SECOND's output with the cache off."""
    return generate(make_llm(enable_prefix_caching=False, num_blocks=64), SECOND)


def assert_same_output(out, cold) -> None:
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids
    for x, y in zip(out.outputs[0].logprobs, cold.outputs[0].logprobs, strict=True):
        assert x.keys() == y.keys() and all(math.isclose(x[k], y[k], abs_tol=1e-4) for k in x)


def checkpoint_on_device(llm: LLM) -> bool:
    manager = llm.engine.core.manager
    return manager.state.lookup(manager.block_hashes(Request("probe", SECOND))[5]) is not None


@pytest.mark.parametrize("mode", ["write_back", "write_through"])
def test_a_prefix_whose_blocks_and_checkpoint_left_the_device_hits_from_the_host_tier(make_llm, cold, mode):
    llm = make_llm(kv_offload_cpu="1MiB", kv_offload_mode=mode)
    generate(llm, DOCUMENT)
    assert checkpoint_on_device(llm)
    for filler in FILLERS:
        generate(llm, filler)
    llm.engine.core.offload.writer.flush()
    assert not checkpoint_on_device(llm)
    found = llm.lookup({"prompt_token_ids": SECOND})
    assert found.cached_tokens_by_tier == {"device": 0, "CPU": 96}
    out = generate(llm, SECOND)
    assert out.num_cached_tokens == 96
    [tier] = llm.stats().kv_offload
    assert (tier.hit_tokens, tier.blocks_loaded) == (96, 7)  # six blocks and the checkpoint
    assert_same_output(out, cold)


@pytest.fixture(params=["disk", "redis"])
def persistent_tier(request, tmp_path) -> tuple[dict, str]:
    """Engine options of a tier that outlives the engine, and its medium."""
    if request.param == "disk":
        return {"kv_offload_disk": f"{tmp_path}/kv:4MiB"}, "DISK"
    return {"kv_offload_redis": request.getfixturevalue("redis_server").url}, "REDIS"


def test_a_persistent_tier_serves_a_prefix_and_its_checkpoint_to_the_next_engine(make_llm, cold, persistent_tier):
    options, medium = persistent_tier
    first = make_llm(**options)
    generate(first, DOCUMENT)
    first.engine.close()  # writes what is queued (and releases the disk tier's directory)
    second = make_llm(**options)
    assert second.lookup({"prompt_token_ids": SECOND}).cached_tokens_by_tier == {"device": 0, medium: 96}
    out = generate(second, SECOND)
    assert out.num_cached_tokens == 96
    assert_same_output(out, cold)
