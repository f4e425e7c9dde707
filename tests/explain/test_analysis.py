"""What explain computes from prompts alone: hit rates, matches, divergence points, reasons, the fix."""

import random
from dataclasses import replace

import pytest

from prefixcache.core import KVCacheGroupSpec, KVCacheManager, RetentionRange
from prefixcache.explain.analysis import (
    REFINES,
    ExplainConfig,
    WhatIfBreakpoint,
    block_hit_rate,
    explain,
    locate_message,
)
from prefixcache.explain.log import Prompt
from tests.core.conftest import admit, make_request
from tests.explain.conftest import decode_ids, prompts_of

HEAD = list(range(1000, 1020))  # 20 stable tokens before the varying field
STABLE = list(range(2000, 2040))  # 40 stable tokens after it
QUESTIONS = [list(range(3000 + 100 * q, 3000 + 100 * q + 12)) for q in range(3)]


def stamped(i: int) -> list[int]:
    """HEAD, a 3-token field that differs from every other prompt's in its first token, STABLE, a question."""
    return HEAD + [5000 + i, 6000 + i % 2, 7000 + i] + STABLE + QUESTIONS[i % 3]


def test_a_varying_field_is_found_at_its_position_and_the_fix_is_computed():
    prompts = prompts_of([stamped(i) for i in range(12)])
    result = explain(prompts, ExplainConfig(block_size=16), decode_ids)
    summary = result.divergence
    assert (summary.start, summary.end, summary.count, summary.total) == (20, 20, 11, 11)
    assert summary.kind == "varying"
    assert summary.varying_span == (20, 23)
    assert summary.varying_text == "5001 6001 7001"  # the example is the first prompt parting there
    assert summary.shared_text.endswith("1019") and summary.this_text.startswith("5001")
    moved = prompts_of([HEAD + STABLE + QUESTIONS[i % 3] + [5000 + i, 6000 + i % 2, 7000 + i] for i in range(12)])
    assert summary.prompts_rewritten == 12
    assert summary.fixed_block_hit_rate == pytest.approx(block_hit_rate(moved, 16))
    assert summary.fixed_block_hit_rate > 3 * result.block_hit_rate
    for request in result.requests[1:]:
        assert request.shared_tokens == 20
        assert request.divergence.index == 20 and request.divergence.kind == "varying"
        assert (request.divergence.span_end, request.divergence.other_span_end) == (23, 23)


def test_each_request_names_the_earlier_one_it_shares_most_with_however_far_back():
    a, b = HEAD + STABLE, HEAD + QUESTIONS[0] + STABLE
    prompts = prompts_of([a, b, list(range(9000, 9030)), a[:50] + [1, 2, 3], b + [4]])
    result = explain(prompts, ExplainConfig(block_size=16), decode_ids)
    assert [r.match_line for r in result.requests] == [None, 1, None, 1, 2]
    assert [r.shared_tokens for r in result.requests] == [0, 20, 0, 50, len(b)]
    fourth = result.requests[3]
    assert fourth.divergence.index == 50
    assert fourth.divergence.this_text == "1 2 3" and fourth.divergence.other_text.startswith("2030 2031")
    assert result.requests[4].divergence is None  # it extends the second prompt: nothing parts


def test_reordered_sections_are_told_apart_from_a_varying_field():
    sections = [list(range(s, s + 20)) for s in (10_000, 11_000, 12_000)]
    orders = [(0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0)]
    prompts = prompts_of([HEAD + [t for k in order for t in sections[k]] + [i] for i, order in enumerate(orders)])
    result = explain(prompts, ExplainConfig(block_size=16), decode_ids)
    second, third, fourth = result.requests[1:]
    assert (second.divergence.index, second.divergence.kind) == (40, "inserted")
    assert (second.divergence.span_end, second.divergence.other_span_end) == (40, 60)  # the other has section 1 first
    assert (third.match_line, third.shared_tokens, third.divergence.kind) == (2, 20, "inserted")  # ties: most recent
    assert (fourth.match_line, fourth.divergence.index) == (3, 40)
    assert (result.divergence.start, result.divergence.count, result.divergence.kind) == (40, 2, "inserted")
    assert "fixed order" in result.divergence.fix
    assert result.divergence.fixed_block_hit_rate is None


def test_prompts_that_differ_after_a_shared_prefix_need_no_fix():
    prompts = prompts_of([HEAD + STABLE + [40_000 + 100 * i + k for k in range(30)] for i in range(5)])
    result = explain(prompts, ExplainConfig(block_size=16), decode_ids)
    assert (result.divergence.start, result.divergence.kind) == (60, "differs")
    assert "nothing to move" in result.divergence.fix


def test_block_alignment_and_partial_blocks_are_counted_exactly():
    first = list(range(100, 140))  # 40 tokens
    second = first[:37] + list(range(500, 510))  # shares 37 tokens, 47 in all
    short = list(range(800, 810))  # 10 tokens: shorter than one block
    result = explain(prompts_of([first, second, short, short]), ExplainConfig(block_size=16), decode_ids)
    one, two, _, four = result.requests
    assert (two.infinite_hit, two.block_hit) == (37, 32)
    assert two.missed == {
        "no_checkpoint": 0,
        "never_seen": 0,
        "different_salt": 0,
        "evicted": 0,
        "after_evicted": 0,
        "expired": 0,
        "after_expired": 0,
        "evicted_below_retained": 0,
        "after_evicted_below_retained": 0,
        "shorter_than_block": 0,
        "tail": 15,
    }
    assert one.missed["never_seen"] == 32 and one.missed["tail"] == 8
    assert (four.infinite_hit, four.block_hit) == (9, 0)
    assert four.missed["shorter_than_block"] == 10 and four.reason == "shorter_than_block"
    total = 40 + 47 + 10 + 10
    assert result.infinite_hit_rate == pytest.approx((37 + 9) / total)
    assert result.block_hit_rate == pytest.approx(32 / total)
    assert result.alignment_loss == pytest.approx((37 + 9 - 32) / total)
    assert sum(result.missed.values()) + 32 == total


def test_salts_keep_namespaces_apart_and_name_the_reason():
    prompt = list(range(100, 150))
    result = explain(
        prompts_of([prompt, prompt, prompt, prompt], salts=[None, "b", "b", None]), ExplainConfig(), decode_ids
    )
    assert [r.block_hit for r in result.requests] == [0, 0, 48, 48]
    assert result.requests[1].reason == "different_salt" and result.requests[1].match_line is None
    assert result.requests[1].missed["different_salt"] == 48
    assert result.requests[2].match_line == 2 and result.requests[3].match_line == 1
    adapter = explain([Prompt(1, prompt), Prompt(2, prompt, lora_name="adapter")], ExplainConfig(), decode_ids)
    assert adapter.requests[1].reason == "different_salt" and adapter.requests[1].block_hit == 0


def test_a_small_cache_tells_evicted_from_new_on_a_known_sequence():
    """64-token cache (4 blocks): A, then B evicts A's blocks, then A again: an infinite cache would hit."""
    a, b = list(range(100, 149)), list(range(500, 549))  # 49 tokens: 3 full blocks and one token
    result = explain(prompts_of([a, a, b, a]), ExplainConfig(block_size=16, capacity_tokens=64), decode_ids)
    assert [r.block_hit for r in result.requests] == [0, 48, 0, 48]
    assert [r.capacity_hit for r in result.requests] == [0, 48, 0, 0]
    assert [r.reason for r in result.requests] == ["never_seen", "tail", "never_seen", "evicted"]
    assert [r.core_reason for r in result.requests] == ["new", "partial_block", "new", "evicted"]
    assert result.requests[3].missed["evicted"] == 48
    assert result.capacity_hit_rate == pytest.approx(48 / (4 * 49))
    big = explain(prompts_of([a, a, b, a]), ExplainConfig(block_size=16, capacity_tokens=4096), decode_ids)
    assert [r.capacity_hit for r in big.requests] == [r.block_hit for r in big.requests]


def test_the_replay_matches_the_managers_own_hits_and_miss_reasons():
    rng = random.Random(3)
    bases = [[rng.randrange(1, 50) for _ in range(40)] for _ in range(4)]
    token_lists = [rng.choice(bases)[: rng.randrange(20, 41)] + [rng.randrange(1, 50)] for _ in range(30)]
    result = explain(prompts_of(token_lists), ExplainConfig(block_size=8, capacity_tokens=96), decode_ids)
    manager = KVCacheManager(num_blocks=12, block_size=8, evicted_record_size=10_000)  # remembers every eviction
    for i, tokens in enumerate(token_lists):
        found = manager.lookup(tokens)
        assert result.requests[i].capacity_hit == found.cached_tokens
        # explain's reasons refine the engine's: summed by the reason they refine, they are the engine's counts
        refined = result.requests[i].missed
        by_core = {core: sum(n for r, n in refined.items() if REFINES[r] == core) for core in found.missed_tokens}
        assert by_core == found.missed_tokens, (i, refined, found.missed_tokens)
        assert result.requests[i].core_reason == found.first_miss_reason
        request = make_request(tokens)
        admit(manager, request)
        manager.free(request)


def test_shared_prefixes_agree_with_a_brute_force_search():
    rng = random.Random(7)
    token_lists = [[rng.randrange(3) for _ in range(rng.randrange(1, 12))] for _ in range(80)]
    salts = [rng.choice([None, "x"]) for _ in token_lists]
    result = explain(prompts_of(token_lists, salts), ExplainConfig(block_size=2), decode_ids)
    for i, request in enumerate(result.requests):
        best = 0
        for j in range(i):
            if salts[j] == salts[i]:
                a, b = token_lists[i], token_lists[j]
                best = max(best, next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b))))
        assert request.shared_tokens == best
        if request.match_line is not None:
            other = token_lists[request.match_line - 1]
            assert token_lists[i][:best] == other[:best]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size"),
        ({"capacity_tokens": 8}, "capacity_tokens"),
        ({"eviction_policy": "fifo"}, "eviction policy"),
        ({"hash_algo": "md5"}, "hash algorithm"),
    ],
)
def test_bad_settings_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExplainConfig(**kwargs)


def test_a_prompt_larger_than_the_cache_is_a_clear_error():
    with pytest.raises(ValueError, match="more than the capacity"):
        explain(prompts_of([list(range(100))]), ExplainConfig(block_size=16, capacity_tokens=32), decode_ids)


def test_every_system_prompt_with_a_varying_field_gets_it_moved():
    """Two system prompts, their fields at tokens 20 and 25: the computed fix moves both."""
    other_head = list(range(8000, 8025))

    def field(i: int) -> list[int]:
        return [5000 + i, 6000 + i % 2, 7000 + i]

    token_lists = [(HEAD if i % 2 else other_head) + field(i) + STABLE + QUESTIONS[i % 3] for i in range(16)]
    result = explain(prompts_of(token_lists), ExplainConfig(block_size=16), decode_ids)
    summary = result.divergence
    assert (summary.start, summary.end, summary.kind, summary.prompts_rewritten) == (20, 25, "varying", 16)
    moved = [(HEAD if i % 2 else other_head) + STABLE + QUESTIONS[i % 3] + field(i) for i in range(16)]
    assert summary.fixed_block_hit_rate == pytest.approx(block_hit_rate(prompts_of(moved), 16))


def test_the_replay_of_a_hybrid_model_matches_its_managers_hits():
    """With a sliding-window group a block that left the window is the first to go: the replay admits as the
    engine would, through the model's groups."""
    groups = (KVCacheGroupSpec(), KVCacheGroupSpec(sliding_window=16))
    rng = random.Random(5)
    bases = [[rng.randrange(1, 50) for _ in range(48)] for _ in range(3)]
    token_lists = [rng.choice(bases)[: rng.randrange(24, 49)] + [rng.randrange(1, 50)] for _ in range(30)]
    config = ExplainConfig(block_size=8, capacity_tokens=160, kv_cache_groups=groups)
    result = explain(prompts_of(token_lists), config, decode_ids)
    manager = KVCacheManager(num_blocks=20, block_size=8, groups=groups)
    for i, tokens in enumerate(token_lists):
        assert result.requests[i].capacity_hit == manager.lookup(tokens).cached_tokens
        request = make_request(tokens)
        admit(manager, request)
        manager.free(request)
    assert sum(r.capacity_hit for r in result.requests) > 0


def test_the_differing_span_is_shown_marked_in_its_surroundings():
    prompts = prompts_of([stamped(i) for i in range(3)])
    result = explain(prompts, ExplainConfig(block_size=16, window_tokens=2), decode_ids)
    second = result.requests[1].divergence
    assert second.this_context == "…1018 1019⟦5001 6001 7001⟧2000 2001…"
    assert second.other_context == "…1018 1019⟦5000 6000 7000⟧2000 2001…"
    assert result.divergence.this_context == second.this_context  # the summary's example is the second prompt


def test_a_span_at_the_start_or_end_has_no_ellipsis_there_and_an_open_one_marks_its_first_tokens():
    prompts = prompts_of([[1, 2, 3, 4, 5, 6], [1, 2, 9, 9, 9, 9]])
    divergence = explain(prompts, ExplainConfig(block_size=4, window_tokens=3), decode_ids).requests[1].divergence
    assert divergence.kind == "differs"
    assert divergence.this_context == "1 2⟦9 9 9⟧…" and divergence.other_context == "1 2⟦3 4 5⟧…"


def test_a_chat_divergence_names_the_message_it_is_in(tokenizer):
    from prefixcache.engine.chat_breakpoints import chat_token_ids

    def chat(time: str, question: str) -> tuple[dict[str, str], ...]:
        system = f"You are a helpful assistant. Current time: {time}. Answer briefly and truthfully."
        return ({"role": "system", "content": system}, {"role": "user", "content": question})

    conversations = [chat("14:05", "Why cache prefixes?"), chat("14:35", "Why cache prefixes?"),
                     chat("14:35", "The quick brown fox?")]  # fmt: skip
    prompts = [
        Prompt(line, chat_token_ids(tokenizer, list(messages)), messages=messages)
        for line, messages in enumerate(conversations, start=1)
    ]
    decode = tokenizer.decode
    result = explain(prompts, ExplainConfig(block_size=4, window_tokens=6), decode)
    in_system, in_question = result.requests[1].divergence, result.requests[2].divergence
    assert (in_system.message_index, in_system.message_role) == (0, "system")
    assert in_system.this_context.endswith(": 14:⟦3⟧5. Answer briefly…")
    assert in_system.other_context.endswith(": 14:⟦0⟧5. Answer briefly…")
    assert (in_question.message_index, in_question.message_role) == (1, "user")
    assert "⟦The" in in_question.this_context


def test_locating_a_span_prefers_the_longest_context_and_knows_template_text():
    messages = [{"role": "system", "content": "time 10:05 now"}, {"role": "user", "content": "at 10:05 please"}]
    assert locate_message(messages, "at ", "10:05") == 1  # "10:05" alone is in both; its context decides
    assert locate_message(messages, "<|system|>time ", "10:05") == 0  # the window begins in template markup
    assert locate_message(messages, "<|end|>", "<|user|>") is None  # the template's own text
    assert locate_message(None, "a", "b") is None


def test_tokens_after_evicted_blocks_count_as_evicted_like_the_engine_counts_them():
    """A, then B evicts A, then A's first two blocks and new text: the engine counts every hittable missed token
    ``evicted`` (the first missing block was evicted); explain splits off those an infinite cache lacks too."""
    a, b = list(range(100, 149)), list(range(500, 549))
    again = a[:32] + list(range(900, 917))  # 49 tokens: 2 of A's blocks, then a new one and a token
    result = explain(prompts_of([a, b, again]), ExplainConfig(block_size=16, capacity_tokens=64), decode_ids)
    last = result.requests[2]
    assert (last.block_hit, last.capacity_hit) == (32, 0)
    assert {r: n for r, n in last.missed.items() if n} == {"evicted": 32, "after_evicted": 16, "tail": 1}
    assert result.missed_by_core_reason["evicted"] == 48
    manager = KVCacheManager(num_blocks=4, block_size=16)
    for tokens in (a, b):
        request = make_request(tokens)
        admit(manager, request)
        manager.free(request)
    assert manager.lookup(again).missed_tokens == {
        "new": 0,
        "evicted": 48,
        "expired": 0,
        "evicted_below_retained": 0,
        "partial_block": 1,
        "skipped": 0,
        "no_checkpoint": 0,
    }


def retention_log(timestamps) -> list[Prompt]:
    """A (kept 10 s at priority 80), B, C (plain), then A and B again: 49 tokens each, 3 whole blocks and one
    token, through a cache of 8 blocks."""
    a, b, c = (list(range(start, start + 49)) for start in (100, 500, 900))
    keep = (RetentionRange(0, 48, 80, 10.0),)
    order = [(a, keep), (b, ()), (c, ()), (a, keep), (b, ())]
    return [
        Prompt(line, tokens, retention=retention, timestamp=None if timestamps is None else timestamps[line - 1])
        for line, (tokens, retention) in enumerate(order, start=1)
    ]


def nonzero(request) -> dict[str, int]:
    return {reason: n for reason, n in request.missed.items() if n}


def test_a_timed_replay_lets_ttls_end_and_counts_the_misses_expired():
    """At 200 s A's blocks, freed at 100 s with a 10 s TTL, have expired: C evicts two of them first (tail first),
    so A hits one block; A's renewed directive then takes no room from B, whose blocks go to plain pressure."""
    config = ExplainConfig(block_size=16, capacity_tokens=128)
    result = explain(retention_log([0, 100, 200, 300, 400]), config, decode_ids)
    assert result.timed and result.directed_requests == 2
    again_a, again_b = result.requests[3:]
    assert (again_a.capacity_hit, nonzero(again_a)) == (16, {"expired": 32, "tail": 1})
    assert (again_b.capacity_hit, nonzero(again_b)) == (16, {"evicted": 32, "tail": 1})
    assert again_a.core_reason == "expired"
    assert result.missed_by_core_reason == {
        "new": 3 * 48,
        "evicted": 32,
        "expired": 32,
        "evicted_below_retained": 0,
        "partial_block": 5,
        "skipped": 0,
        "no_checkpoint": 0,
    }


def test_without_timestamps_no_ttl_ends_and_plain_blocks_are_lost_below_retained_ones():
    """The same log untimed: A's blocks stay retained, so C takes B's two tail blocks while they sit free; A hits
    whole, and B misses them as evicted below retained blocks."""
    result = explain(retention_log(None), ExplainConfig(block_size=16, capacity_tokens=128), decode_ids)
    assert not result.timed
    again_a, again_b = result.requests[3:]
    assert (again_a.capacity_hit, nonzero(again_a)) == (48, {"tail": 1})
    assert (again_b.capacity_hit, nonzero(again_b)) == (16, {"evicted_below_retained": 32, "tail": 1})
    assert result.missed_by_core_reason["evicted_below_retained"] == 32


def test_a_what_if_breakpoint_keeps_the_shared_prefix_through_a_flood():
    """X0 and X1 share a 32-token system prefix; two 81-token floods between them flush it from 8 blocks under
    LRU. A breakpoint after the system messages (the floods have none) keeps it: X1 hits its 32 tokens."""
    system = list(range(100, 132))
    x0, x1 = system + list(range(200, 217)), system + list(range(300, 317))
    floods = [list(range(1000 * k, 1000 * k + 81)) for k in (1, 2)]
    prompts = [
        Prompt(1, x0, system_end=32),
        Prompt(2, floods[0]),
        Prompt(3, floods[1]),
        Prompt(4, x1, system_end=32),
    ]
    config = ExplainConfig(block_size=16, capacity_tokens=128, breakpoint=WhatIfBreakpoint("system"))
    result = explain(prompts, config, decode_ids)
    total = 49 + 81 + 81 + 49
    assert result.capacity_hit_rate == 0 and result.breakpoint_hit_rate == pytest.approx(32 / total)
    assert result.breakpoint_requests == 2
    assert nonzero(result.requests[3]) == {"evicted": 32, "after_evicted": 16, "tail": 1}  # as logged
    at_tokens = explain(prompts, replace(config, breakpoint=WhatIfBreakpoint(32, "1h")), decode_ids)
    assert at_tokens.breakpoint_requests == 4  # every prompt has 32 tokens: the floods' heads are kept too
    assert at_tokens.breakpoint_hit_rate == 0  # so the floods' retained heads push X0's out (the share is 4 blocks)


def test_a_what_if_breakpoint_is_checked():
    with pytest.raises(ValueError, match="needs a replay"):
        ExplainConfig(breakpoint=WhatIfBreakpoint("system"))
    with pytest.raises(ValueError, match="'system' or a positive number"):
        WhatIfBreakpoint(0)
    with pytest.raises(ValueError, match="ttl is one of 5m, 1h"):
        WhatIfBreakpoint("system", "2h")
