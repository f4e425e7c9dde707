"""The scheduling policy on a real engine (the tiny random model): ``cache-aware`` changes the order requests run
in, never what they generate, and serves cached questions ahead of the cold prompts that came before them."""

import random

import pytest

from prefixcache.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def mixed_prompts() -> dict[str, list[int]]:
    """Cold prompts of 40 tokens and questions behind one 32-token prefix, interleaved, a cold one first."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, 500) for _ in range(32)]
    prompts = {}
    for i in range(4):
        prompts[f"cold{i}"] = [rng.randrange(3, 500) for _ in range(40)]
        prompts[f"question{i}"] = prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(2, 6))]
    return prompts


def serve(llm, prompts: dict[str, list[int]]) -> tuple[list[str], dict[str, list[int]], dict[str, int]]:
    """All prompts queued at once, stepped to the end: the order their first tokens came in, what each
    generated and its cached tokens."""
    engine = llm.engine
    for request_id, prompt in prompts.items():
        engine.add_request({"prompt_token_ids": prompt}, GREEDY, request_id=request_id)
    first_tokens: list[str] = []
    tokens, cached = {}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id not in first_tokens:
                first_tokens.append(output.request_id)
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
                cached[output.request_id] = output.num_cached_tokens
    return first_tokens, tokens, cached


@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_cache_aware_generates_what_fcfs_does_and_serves_the_cached_questions_first(make_llm, max_num_seqs):
    prompts = mixed_prompts()
    results = {}
    for policy in ("fcfs", "cache-aware"):
        llm = make_llm(scheduling_policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=48)
        serve(llm, {"warm": prompts["question0"][:32] + [7]})  # the questions' prefix is cached before they come
        results[policy] = serve(llm, prompts)
    fcfs_order, fcfs_tokens, fcfs_cached = results["fcfs"]
    order, tokens, cached = results["cache-aware"]
    assert tokens == fcfs_tokens and cached == fcfs_cached
    assert all(cached[f"question{i}"] == 32 for i in range(4))
    if max_num_seqs == 1:  # one at a time: the order they were queued in
        assert fcfs_order == list(prompts)
    # Every question's first token before any cold prompt's (a question's 2-5 uncached tokens against a cold
    # prompt's 40), the fewest first; the others pass each other over only by their own few tokens.
    questions = [f"question{i}" for i in range(4)]
    assert sorted(order[:4]) == questions and sorted(order[4:]) == ["cold0", "cold1", "cold2", "cold3"]
    assert order[0] == min(questions, key=lambda q: (len(prompts[q]), q)) != "question0"
