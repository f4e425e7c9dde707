"""The engine on a model with recurrent layers: a tiny Qwen3.5 (three Gated DeltaNet layers, then full attention)
with blocks of 16 tokens, its state checkpoints in the same KV cache memory.

Prefill runs in chunks of 40 tokens, so chunk boundaries fall inside blocks and every checkpoint is saved inside
a chunk; sparse checkpoints lie every 16 blocks (256 tokens, the closest the policy places them). Each
scenario's greedy tokens and log-probabilities equal an engine's with the cache off (float32), and each request
hits exactly where a checkpoint of the policy lies: a sparse one on the second request sharing a prefix, a
junction left by the second on the third, a conversation's frontier on its next turn.
"""

from __future__ import annotations

import math
import random

import pytest

from prefixcache.core import FULL_ATTENTION
from prefixcache.core.kv_cache_groups import RECURRENT_STATE
from prefixcache.engine import LLM, SamplingParams
from tests.model.conftest import write_checkpoint

BLOCK_SIZE = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
rng = random.Random(5)
DOCUMENT = [rng.randrange(3, 500) for _ in range(300)]  # 18 blocks and 12 tokens


def tokens(n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    from prefixcache.model import load_model

    return load_model(str(write_checkpoint(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5")), dtype="float32")


@pytest.fixture
def make_llm(make_llm, qwen35):
    """The shared factory (leak check, close) on the tiny Qwen3.5 in 16-token blocks, its pool sized by memory so
    that the checkpoints get their share (41 of them in 1200 KiB)."""

    def make(**kwargs) -> LLM:
        kwargs.setdefault("kv_cache_memory", "1200KiB")
        kwargs.setdefault("num_blocks", None)
        kwargs.setdefault("max_num_batched_tokens", 40)
        return make_llm(loaded=qwen35, block_size=BLOCK_SIZE, **kwargs)

    return make


def serve(llm: LLM, prompts: list[list[int]]) -> list:
    """One request after the other, as a conversation or a stream of questions arrives."""
    return [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0] for p in prompts]


def assert_same_outputs(cached: list, cold: list) -> None:
    for a, b in zip(cached, cold, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys() and all(math.isclose(x[k], y[k], abs_tol=1e-4) for k in x)


def test_the_state_group_is_sized_within_the_kv_cache_memory(make_llm, qwen35):
    core = make_llm().engine.core
    assert core.manager.groups == (FULL_ATTENTION, RECURRENT_STATE)
    state = core.manager.state
    slot = qwen35.model.state_bytes_per_slot()
    assert (state.num_working_slots, state.num_checkpoint_slots) == (64, int(1200 * 1024 * 0.25) // slot)
    assert state.policy.sparse_every_blocks == 16  # 1,024 tokens: 64 blocks over half of 41 slots, at least 256
    assert core.manager.num_blocks == (1200 * 1024 - state.num_slots * slot) // core.block_bytes
    assert core.info().kv_cache_bytes <= 1200 * 1024
    assert len(core.runner.state_cache[0][0]) == state.num_slots


def test_sparse_then_junction_hits_give_the_outputs_of_no_cache(make_llm):
    prompts = [
        DOCUMENT + tokens(5),
        DOCUMENT[:262] + tokens(4),  # parts inside block 16: the sparse checkpoint at 16 blocks
        DOCUMENT[:285] + tokens(3),  # parts inside block 17: sparse at 16 again, leaves a junction at 17
        DOCUMENT[:285] + tokens(6),  # the junction: all 17 blocks
    ]
    llm = make_llm()
    cached = serve(llm, prompts)
    assert [o.num_cached_tokens for o in cached] == [0, 256, 256, 272]
    stats = llm.engine.core.stats()
    assert (stats.state_checkpoint_hits, stats.state_checkpoints_evicted) == (3, 0)
    assert stats.state_checkpoints_saved == sum(llm.engine.core.manager.state.stats.saved.values()) > 3
    assert_same_outputs(cached, serve(make_llm(enable_prefix_caching=False), prompts))


def test_the_next_turn_of_a_conversation_hits_the_last_full_block_of_the_previous_one(make_llm):
    llm = make_llm()
    first = DOCUMENT[:40]
    turn = serve(llm, [first])[0]
    history = first + list(turn.outputs[0].token_ids)  # 46 tokens, the last not computed: 45, 2 full blocks
    second = history + tokens(7)
    cached = serve(llm, [second])
    assert cached[0].num_cached_tokens == 32
    stats = llm.engine.core.manager.state.stats
    assert stats.hits["finish"] == 1
    assert_same_outputs(cached, serve(make_llm(enable_prefix_caching=False), [second]))


def test_a_batch_with_preemption_and_a_salt_keeps_the_outputs(make_llm):
    """Requests running together, some preempted for lack of blocks (their working states go back), salted ones
    never sharing with the others."""
    prompts = [DOCUMENT[: 30 + 40 * i] + tokens(3) for i in range(6)]
    params = [{"prompt_token_ids": p, "cache_salt": "t1" if i % 3 == 2 else None} for i, p in enumerate(prompts)]
    tight = make_llm(num_blocks=20, max_num_batched_tokens=48)
    cached = tight.generate(params, GREEDY, use_tqdm=False)
    assert tight.engine.core.scheduler.num_preemptions > 0
    cold = make_llm(enable_prefix_caching=False).generate(params, GREEDY, use_tqdm=False)
    assert_same_outputs(cached, cold)


def test_a_second_conversation_sharing_the_first_two_messages_hits_at_their_end(make_llm, qwen35):
    """``LLM.chat`` hints each message's end: the second conversation resumes from the checkpoint at the block
    boundary before the end of the messages it shares, where no other rule left one (the prompts are shorter
    than the sparse interval, the first conversation's frontier lies past where they part); the same token ids
    sent without the hints hit nothing."""
    from prefixcache.engine.chat_breakpoints import chat_token_ids
    from tests.helpers import CORPUS

    shared = [{"role": "system", "content": " ".join(CORPUS)}, {"role": "user", "content": CORPUS[1] + CORPUS[0]}]
    conversations = [
        [*shared, {"role": "assistant", "content": "Yes. " + CORPUS[3]}, {"role": "user", "content": CORPUS[2]}],
        [*shared, {"role": "assistant", "content": "No. " + CORPUS[2]}, {"role": "user", "content": CORPUS[0]}],
    ]
    tokenizer = qwen35.tokenizer
    shared_end = len(chat_token_ids(tokenizer, shared, add_generation_prompt=False))
    llm = make_llm()
    cached = [llm.chat(c, GREEDY, use_tqdm=False)[0] for c in conversations]
    assert [o.num_cached_tokens for o in cached] == [0, shared_end // BLOCK_SIZE * BLOCK_SIZE] and shared_end > 64
    assert llm.engine.core.manager.state.stats.hits["hint"] == 1
    assert_same_outputs(cached, make_llm(enable_prefix_caching=False).chat(conversations, GREEDY, use_tqdm=False))
    unhinted = make_llm()
    prompts = [chat_token_ids(tokenizer, c) for c in conversations]
    assert [o.num_cached_tokens for o in serve(unhinted, prompts)] == [0, 0]
