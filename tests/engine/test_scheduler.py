"""The scheduler without a model (and without torch): each step's chunks are pinned exactly.

``step()`` plays the model runner's part: every chunk that reaches the end of its request's tokens
"samples" one token, appended as the engine core would.
"""

import itertools
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.core import KVCacheManager
from prefixcache.engine import scheduler as scheduler_module
from prefixcache.engine.request import EngineRequest, RequestStatus
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.scheduler import Scheduler
from tests.engine.test_waiting_queue import ReferenceQueue

BLOCK_SIZE = 4
_ids = itertools.count()


def make_request(tokens, request_id=None, max_tokens=8) -> EngineRequest:
    return EngineRequest(
        request_id=request_id or f"r{next(_ids)}",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0),
    )


def make_scheduler(
    num_blocks=32, max_num_seqs=8, max_num_batched_tokens=16, policy="fcfs", policy_options=None, **kwargs
) -> Scheduler:
    manager = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, **kwargs)
    return Scheduler(manager, max_num_seqs, max_num_batched_tokens, policy, **(policy_options or {}))


def step(scheduler: Scheduler) -> list[tuple[str, int, int, list[int]]]:
    """Schedule one step, sample a token for every finished prefill/decode chunk; the step as tuples."""
    out = scheduler.schedule()
    for chunk in out.chunks:
        if chunk.samples:
            chunk.request.append_output_token_ids([7])
    assert all(len(c.block_ids) == 1 for c in out.chunks)  # one KV cache group
    return [(c.request.request_id, c.start, c.num_new_tokens, c.block_ids[0]) for c in out.chunks]


def test_token_budget_chunks_the_prompt_that_does_not_fit():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    a, b = make_request(range(10), "a"), make_request(range(100, 110), "b")
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert step(scheduler) == [("a", 0, 10, [0, 1, 2]), ("b", 0, 6, [3, 4])]
    assert b.num_output_tokens == 0 and a.num_output_tokens == 1
    # Running first, in arrival order: a decodes, b finishes its prompt.
    assert step(scheduler) == [("a", 10, 1, [0, 1, 2]), ("b", 6, 4, [3, 4, 5])]
    assert step(scheduler) == [("a", 11, 1, [0, 1, 2]), ("b", 10, 1, [3, 4, 5])]


def test_max_num_seqs_caps_the_running_batch():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    requests = [make_request(range(i * 10, i * 10 + 5), f"q{i}") for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    assert [c[0] for c in step(scheduler)] == ["q0", "q1"]
    assert [r.request_id for r in scheduler.waiting] == ["q2"]
    scheduler.finish(requests[0], RequestStatus.FINISHED)
    assert [c[:3] for c in step(scheduler)] == [("q1", 5, 1), ("q2", 0, 5)]


def test_a_cached_prefix_is_not_charged_to_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    first = make_request(range(12), "first")
    scheduler.add_request(first)
    step(scheduler)
    scheduler.finish(first, RequestStatus.FINISHED)
    second, third = make_request([*range(12), 50, 51, 52, 53], "second"), make_request(range(200, 212), "third")
    scheduler.add_request(second)
    scheduler.add_request(third)
    # 12 cached tokens: second costs 4 of the 16, so third gets the other 12.
    assert step(scheduler) == [("second", 12, 4, [0, 1, 2, 3]), ("third", 0, 12, [4, 5, 6])]
    assert second.num_cached_tokens == 12 and third.num_cached_tokens == 0


@pytest.mark.parametrize("policy", ["fcfs", "cache-aware"])
def test_running_out_of_blocks_preempts_the_newest_request_to_the_front_of_the_queue(policy):
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=64, policy=policy)
    old, new = make_request(range(8), "old"), make_request(range(100, 108), "new")
    scheduler.add_request(old)
    scheduler.add_request(new)
    assert step(scheduler) == [("old", 0, 8, [0, 1]), ("new", 0, 8, [2, 3])]
    # Decodes need a third block each: old takes the last free one, new must go.
    assert step(scheduler) == [("old", 8, 1, [0, 1, 4])]
    assert new.status is RequestStatus.WAITING and new.num_preemptions == 1
    assert [r.request_id for r in scheduler.waiting] == ["new"] and scheduler.num_preemptions == 1
    assert new.num_computed_tokens == 0
    scheduler.finish(old, RequestStatus.FINISHED)
    # Resumed, it hits its own prompt blocks (still cached) and recomputes only its sampled token.
    assert step(scheduler) == [("new", 8, 1, [2, 3, 4])]


@pytest.mark.parametrize("policy", ["fcfs", "cache-aware"])
def test_a_preempted_step_admits_no_waiting_request(policy):
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=64, policy=policy)
    for name, start in (("a", 0), ("b", 100)):
        scheduler.add_request(make_request(range(start, start + 8), name))
    step(scheduler)
    scheduler.add_request(make_request(range(300, 302), "late"))
    assert [c[0] for c in step(scheduler)] == ["a"]
    assert [r.request_id for r in scheduler.waiting] == ["b", "late"]


def warm(scheduler: Scheduler, tokens=range(12)) -> None:
    """Run a request over ``tokens`` and finish it: its full blocks stay cached (ids 0.. in order)."""
    request = make_request(tokens, "warm")
    scheduler.add_request(request)
    step(scheduler)
    scheduler.finish(request, RequestStatus.FINISHED)


@pytest.mark.parametrize(("policy", "first"), [("fcfs", ("cold1", 0, 12, [3, 4, 5])), ("cache-aware", None)])
def test_cache_aware_admits_a_cached_request_ahead_of_the_cold_ones_before_it(policy, first):
    scheduler = make_scheduler(max_num_seqs=1, policy=policy)
    warm(scheduler)
    cold1, cold2 = make_request(range(100, 112), "cold1"), make_request(range(200, 212), "cold2")
    cached = make_request([*range(12), 50, 51, 52, 53], "cached")
    for request in (cold1, cold2, cached):
        scheduler.add_request(request)
    if first is not None:  # fcfs: the cold ones in arrival order
        assert step(scheduler) == [first]
        return
    # 12 of its 16 tokens cached: 4 to compute against the cold ones' 12.
    assert step(scheduler) == [("cached", 12, 4, [0, 1, 2, 3])]
    assert [r.request_id for r in scheduler.waiting] == ["cold1", "cold2"]
    assert (scheduler.waiting.passed_tokens(cold1), scheduler.waiting.passed_tokens(cold2)) == (4, 4)
    scheduler.finish(cached, RequestStatus.FINISHED)
    # Equal costs keep arrival order.
    assert step(scheduler) == [("cold1", 0, 12, [4, 5, 6])]


def test_cache_aware_admits_a_passed_over_request_once_it_waited_its_own_prefill():
    scheduler = make_scheduler(max_num_seqs=1, policy="cache-aware")
    warm(scheduler)
    cold = make_request(range(100, 112), "cold")
    questions = [make_request([*range(12), 50 + i, 60, 61, 62], f"q{i}") for i in range(4)]
    for request in (cold, *questions):
        scheduler.add_request(request)
    admitted, passed = [], []
    for _ in range(4):
        passed.append(scheduler.waiting.passed_tokens(cold))
        (chunk,) = step(scheduler)
        admitted.append(chunk)
        scheduler.finish(chunk_request(scheduler, chunk[0]), RequestStatus.FINISHED)
    # Three questions of 4 uncached tokens pass it over: 12 tokens, its own; then it goes before the fourth.
    assert admitted == [
        ("q0", 12, 4, [0, 1, 2, 3]),
        ("q1", 12, 4, [0, 1, 2, 4]),
        ("q2", 12, 4, [0, 1, 2, 5]),
        ("cold", 0, 12, [6, 7, 8]),
    ]
    assert passed == [0, 4, 8, 12] and scheduler.waiting.passed_tokens(questions[3]) == 0
    assert [r.request_id for r in scheduler.waiting] == ["q3"]


def chunk_request(scheduler: Scheduler, request_id: str) -> EngineRequest:
    return next(r for r in scheduler.running if r.request_id == request_id)


@pytest.mark.parametrize("policy", ["fcfs", "cache-aware"])
def test_cache_aware_caps_the_cold_prefill_sharing_a_step_with_a_short_admission(policy):
    options = {"short_prefill_tokens": 4} if policy == "cache-aware" else None
    scheduler = make_scheduler(max_num_seqs=2, policy=policy, policy_options=options)
    warm(scheduler)
    long = make_request(range(100, 132), "long")
    scheduler.add_request(long)
    assert step(scheduler) == [("long", 0, 16, [3, 4, 5, 6])]
    scheduler.add_request(make_request([*range(12), 50, 51, 52, 53], "q"))
    if policy == "fcfs":  # the long prefill takes the whole budget: q waits a step
        assert step(scheduler) == [("long", 16, 16, [3, 4, 5, 6, 7, 8, 9, 10])]
        return
    # q's first token waits for 4 of the long prompt's tokens, not 16; the rest goes on next step.
    assert step(scheduler) == [("long", 16, 4, [3, 4, 5, 6, 7]), ("q", 12, 4, [0, 1, 2, 8])]
    assert step(scheduler) == [("long", 20, 12, [3, 4, 5, 6, 7, 9, 10, 11]), ("q", 16, 1, [0, 1, 2, 8, 12])]


def test_cache_aware_resumes_a_preempted_request_before_a_cheaper_one():
    scheduler = make_scheduler(num_blocks=9, max_num_seqs=2, max_num_batched_tokens=64, policy="cache-aware")
    warm(scheduler, range(4))
    old, new = make_request(range(100, 108), "old", max_tokens=30), make_request(range(200, 208), "new")
    scheduler.add_request(old)
    scheduler.add_request(new)
    for _ in range(9):
        step(scheduler)
    assert step(scheduler) == [("old", 16, 1, [1, 2, 5, 7, 0])]  # its fifth block: new had to go
    assert new.num_preemptions == 1
    cheap = make_request([*range(4), 9], "cheap")
    scheduler.add_request(cheap)
    # new does not fit beside old: cheap, which would, waits behind it rather than pass it over.
    assert step(scheduler) == [("old", 17, 1, [1, 2, 5, 7, 0])]
    assert [r.request_id for r in scheduler.waiting] == ["new", "cheap"]
    scheduler.finish(old, RequestStatus.FINISHED)
    assert [c[:3] for c in step(scheduler)] == [("new", 16, 1), ("cheap", 0, 5)]


@pytest.mark.parametrize(("refresh", "first"), [(64, ("q", 12, 4, [0, 1, 2, 3])), (1, ("c1", 0, 12, [3, 4, 5]))])
def test_cache_aware_looks_waiting_requests_up_again_stalest_first_a_bounded_number_a_step(monkeypatch, refresh, first):
    monkeypatch.setattr(scheduler_module, "REFRESH_PER_STEP", refresh)
    scheduler = make_scheduler(max_num_seqs=1, policy="cache-aware")
    w = make_request(range(12), "w", max_tokens=1)
    c1, q = make_request(range(100, 112), "c1"), make_request([*range(12), 50, 51, 52, 53], "q")
    for request in (w, c1, q):
        scheduler.add_request(request)
    # When q came its prefix was not cached (16 uncached against c1's 12): w goes first, in arrival order.
    assert step(scheduler) == [("w", 0, 12, [0, 1, 2])]
    scheduler.finish(w, RequestStatus.FINISHED)
    # Looked up again, q needs 4 tokens; looked up one a step, c1 (the stalest) is, q keeps its 16.
    assert step(scheduler) == [first]


def test_cache_aware_gives_a_short_request_the_seat_of_a_cold_one_once():
    scheduler = make_scheduler(max_num_seqs=1, policy="cache-aware", policy_options={"short_prefill_tokens": 4})
    warm(scheduler)
    cold = make_request(range(100, 112), "cold", max_tokens=4)
    scheduler.add_request(cold)
    assert step(scheduler) == [("cold", 0, 12, [3, 4, 5])]
    q0, q1 = (make_request([*range(12), 50 + i, 60, 61, 62], f"q{i}", max_tokens=2) for i in range(2))
    scheduler.add_request(q0)
    # q0 needs 4 tokens and the one seat is cold's: cold goes back (due), its blocks cached; q0 runs.
    assert step(scheduler) == [("q0", 12, 4, [0, 1, 2, 6])]
    assert cold.status is RequestStatus.WAITING and cold.num_preemptions == 1
    assert step(scheduler) == [("q0", 16, 1, [0, 1, 2, 6, 7])]
    scheduler.finish(q0, RequestStatus.FINISHED)
    # Resumed first, from its own cached prompt blocks: 12 tokens and the one it sampled.
    assert step(scheduler) == [("cold", 12, 1, [3, 4, 5, 8])]
    scheduler.add_request(q1)
    # Preempted once already, it keeps its seat: q1 waits.
    assert step(scheduler) == [("cold", 13, 1, [3, 4, 5, 8])]
    assert [r.request_id for r in scheduler.waiting] == ["q1"]


PREFIXES = (list(range(12)), list(range(100, 108)), [])
EVENTS = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(range(len(PREFIXES))), st.integers(1, 10), st.integers(1, 3)),  # an arrival
        st.just("step"),
    ),
    min_size=1,
    max_size=40,
)


@pytest.mark.parametrize("policy", ["fcfs", "cache-aware"])
@pytest.mark.parametrize("refresh", [64, 1])
@given(events=EVENTS, max_num_seqs=st.integers(1, 3), num_blocks=st.integers(8, 16))
@settings(max_examples=60, deadline=None)
def test_whole_runs_are_scheduled_as_with_the_reference_queue(policy, refresh, events, max_num_seqs, num_blocks):
    """Arrivals of prompts behind shared prefixes and cold ones, between steps, in a cache small enough to evict
    and preempt: the scheduler on its waiting queue and on the reference (the whole queue ranked each step)
    schedule every step alike. With one look-up a step the estimates go stale, alike in both."""
    options = {"short_prefill_tokens": 4} if policy == "cache-aware" else None
    schedulers = [make_scheduler(num_blocks, max_num_seqs, 12, policy, options) for _ in range(2)]
    schedulers[1].waiting = ReferenceQueue()
    numbers = itertools.count()
    with mock.patch.object(scheduler_module, "REFRESH_PER_STEP", refresh):
        for event in events + ["step"] * 400:  # then steps until all are done
            if event != "step":
                prefix, suffix, max_tokens = event
                number = next(numbers)
                tokens = [*PREFIXES[prefix], *range(1000 + 20 * number, 1000 + 20 * number + suffix)]
                for scheduler in schedulers:
                    scheduler.add_request(make_request(tokens, f"n{number}", max_tokens))
                continue
            if not schedulers[1].has_unfinished():
                continue
            steps = [step(scheduler) for scheduler in schedulers]
            assert steps[0] == steps[1]
            for scheduler in schedulers:
                for request in list(scheduler.running):
                    if request.num_output_tokens >= request.sampling_params.max_tokens:
                        scheduler.finish(request, RequestStatus.FINISHED)
            assert [r.request_id for r in schedulers[0].waiting] == [r.request_id for r in schedulers[1].waiting]
    assert not any(scheduler.has_unfinished() for scheduler in schedulers)
