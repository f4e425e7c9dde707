"""The scheduler without a model (and without torch): each step's chunks are pinned exactly.

``step()`` plays the model runner's part: every chunk that reaches the end of its request's tokens
"samples" one token, appended as the engine core would.
"""

import itertools

from prefixcache.core import KVCacheManager
from prefixcache.engine.request import EngineRequest, RequestStatus
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.scheduler import Scheduler

BLOCK_SIZE = 4
_ids = itertools.count()


def make_request(tokens, request_id=None, max_tokens=8) -> EngineRequest:
    return EngineRequest(
        request_id=request_id or f"r{next(_ids)}",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0),
    )


def make_scheduler(num_blocks=32, max_num_seqs=8, max_num_batched_tokens=16, **kwargs) -> Scheduler:
    manager = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, **kwargs)
    return Scheduler(manager, max_num_seqs, max_num_batched_tokens)


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


def test_running_out_of_blocks_preempts_the_newest_request_to_the_front_of_the_queue():
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=64)
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


def test_a_preempted_step_admits_no_waiting_request():
    scheduler = make_scheduler(num_blocks=5, max_num_batched_tokens=64)
    for name, start in (("a", 0), ("b", 100)):
        scheduler.add_request(make_request(range(start, start + 8), name))
    step(scheduler)
    scheduler.add_request(make_request(range(300, 302), "late"))
    assert [c[0] for c in step(scheduler)] == ["a"]
    assert [r.request_id for r in scheduler.waiting] == ["b", "late"]
