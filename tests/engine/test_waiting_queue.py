"""The waiting queue against a straightforward reference (a deque scanned whole, as the scheduler did before):
random arrivals, preemptions, admissions passing the requests ahead, new estimates and reads of the first ``k``
must agree exactly, through the tree's rebuilds and the heap's compactions."""

from collections import deque

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixcache.engine.request import EngineRequest
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.waiting_queue import Candidate, WaitingQueue


class ReferenceQueue:
    """The order by its definition: each step ranks every waiting request, due ones (preempted, or passed tokens at
    least their uncached) first in queue order, then the others by uncached tokens, ties in queue order; an
    admission adds its uncached tokens to every request ahead of it. O(n) a step; the scheduler's tests plug it in
    to compare whole runs."""

    def __init__(self) -> None:
        self.queue: deque[EngineRequest] = deque()
        self.estimates: dict[EngineRequest, int] = {}
        self.passed: dict[EngineRequest, int] = {}
        self.preempted: set[EngineRequest] = set()

    def __len__(self) -> int:
        return len(self.queue)

    def __contains__(self, request: object) -> bool:
        return request in self.estimates

    def __iter__(self):
        return iter(list(self.queue))

    def append(self, request: EngineRequest, uncached: int) -> None:
        self.queue.append(request)
        self.estimates[request], self.passed[request] = uncached, 0

    def appendleft(self, request: EngineRequest, uncached: int) -> None:
        self.queue.appendleft(request)
        self.estimates[request], self.passed[request] = uncached, 0
        self.preempted.add(request)

    def remove(self, request: EngineRequest, passing: int = 0) -> None:
        for older in self.queue:
            if older is request:
                break
            self.passed[older] += passing
        self.queue.remove(request)
        del self.estimates[request], self.passed[request]
        self.preempted.discard(request)

    def set_uncached(self, request: EngineRequest, uncached: int) -> None:
        self.estimates[request] = uncached

    def passed_tokens(self, request: EngineRequest) -> int:
        return self.passed[request]

    def first(self, k: int) -> list[Candidate]:
        ranked = []
        for position, request in enumerate(self.queue):
            uncached = self.estimates[request]
            due = request in self.preempted or self.passed[request] >= uncached
            ranked.append(((0, 0, position) if due else (1, uncached, position), Candidate(request, uncached, due)))
        ranked.sort(key=lambda pair: pair[0])
        return [candidate for _, candidate in ranked[:k]]


def make_request(number: int) -> EngineRequest:
    return EngineRequest(request_id=f"r{number}", prompt_token_ids=[1, 2], sampling_params=SamplingParams())


class QueueMachine(RuleBasedStateMachine):
    """Small estimates and passes so that requests often tie and often become due; enough insertions to rebuild
    the tree (16 slots at first) and compact the heap several times."""

    def __init__(self) -> None:
        super().__init__()
        self.queue, self.reference = WaitingQueue(), ReferenceQueue()
        self.numbers = iter(range(10**6))

    def waiting(self) -> list[EngineRequest]:
        return list(self.reference.queue)

    @rule(uncached=st.integers(1, 12))
    def arrive(self, uncached):
        request = make_request(next(self.numbers))
        self.queue.append(request, uncached)
        self.reference.append(request, uncached)

    @rule(uncached=st.integers(1, 12))
    def preempt(self, uncached):
        request = make_request(next(self.numbers))
        self.queue.appendleft(request, uncached)
        self.reference.appendleft(request, uncached)

    @precondition(lambda self: len(self.reference))
    @rule(data=st.data(), passing=st.integers(0, 8))
    def admit(self, data, passing):
        request = data.draw(st.sampled_from(self.waiting()))
        self.queue.remove(request, passing)
        self.reference.remove(request, passing)

    @precondition(lambda self: len(self.reference))
    @rule(data=st.data(), k=st.integers(1, 4), passing=st.integers(0, 8))
    def admit_from_the_first(self, data, k, passing):
        """As the scheduler does: one of the first ``k`` in the order is admitted."""
        request = data.draw(st.sampled_from(self.queue.first(k))).request
        self.queue.remove(request, passing)
        self.reference.remove(request, passing)

    @precondition(lambda self: len(self.reference))
    @rule(data=st.data(), uncached=st.integers(1, 12))
    def estimate_again(self, data, uncached):
        request = data.draw(st.sampled_from(self.waiting()))
        self.queue.set_uncached(request, uncached)
        self.reference.set_uncached(request, uncached)

    @rule(k=st.integers(1, 8))
    def first(self, k):
        assert self.queue.first(k) == self.reference.first(k)

    @invariant()
    def same_queue(self):
        assert list(self.queue) == self.waiting() and len(self.queue) == len(self.reference)
        assert [self.queue.passed_tokens(r) for r in self.waiting()] == list(
            map(self.reference.passed_tokens, self.waiting())
        )
        assert self.queue.first(len(self.reference) + 1) == self.reference.first(len(self.reference) + 1)


TestWaitingQueue = QueueMachine.TestCase
TestWaitingQueue.settings = settings(max_examples=100, stateful_step_count=100, deadline=None)


def test_fcfs_estimates_of_zero_keep_the_queue_order_whatever_passes():
    queue = WaitingQueue()
    preempted, *arrivals = (make_request(i) for i in range(40))
    for request in arrivals:
        queue.append(request, 0)
    queue.appendleft(preempted, 0)
    for request in arrivals[:30:3]:
        queue.remove(request, passing=5)
    expected = [preempted, *(r for r in arrivals if r not in arrivals[:30:3])]
    assert [c.request for c in queue.first(len(expected))] == expected == list(queue)
    assert all(c.due for c in queue.first(len(expected)))
