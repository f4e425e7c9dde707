"""Continuous batching with chunked prefill, prefix-cache-aware admission and preemption by recompute.

Each step spends a token budget: running requests first (decodes and unfinished prefill chunks, in
arrival order), then waiting requests in the policy's order. A new request is charged only for
its uncached tokens. When blocks run out, the newest running request is preempted: its blocks are
freed (they stay cached, so it can hit them when it resumes) and it goes back to the front of the
queue.

Policies (``EngineConfig.scheduling_policy``):

- ``fcfs``: first come first served; the first request that does not fit stops admission.
- ``cache-aware``: the fewest uncached prompt tokens first (ranked by the device hit each step, ties by
  arrival). Behind a flood of cold prompts, FCFS makes a request that mostly hits the cache wait for every
  one of them, though it needs a few tokens of prefill. Three rules beside the order:

  - *aging*: a waiting request counts the uncached tokens of the later arrivals admitted ahead of it; once
    they reach its own uncached tokens it is *due*. Due requests, and preempted ones, go first, oldest first,
    and one that does not fit stops admission as in FCFS: being passed over costs a request at most about what
    its own prefill does, so a cold 1,024-token prompt lets many short questions by, and a long cold prompt is
    passed over by two cold prompts of half its size, not by the whole flood.
  - *step sharing*: in a step that admits a *short* request (at most ``short_prefill_tokens`` uncached), the
    other prefill chunks of the step, running and admitted, share at most ``short_prefill_tokens`` tokens,
    so its first token waits for a short step rather than a cold 1,024-token chunk; the cold prefill goes on
    next step.
  - *a seat*: when every seat is taken and the first in line is short, the newest running request that was
    admitted cold, never preempted, with more than one token to go, is preempted for it (its blocks stay
    cached; it goes back due).

The order lives in the waiting queue (``engine/waiting_queue.py``), kept across steps: a step costs O(log n) a seat
and a look-up in the n waiting requests, not a scan of them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prefixcache.config import SCHEDULING_POLICIES
from prefixcache.core import KVCacheManager
from prefixcache.core.state_table import StateWork
from prefixcache.core.sub_block import CopyOp
from prefixcache.engine.request import EngineRequest, RequestStatus
from prefixcache.engine.waiting_queue import WaitingQueue

if TYPE_CHECKING:
    from prefixcache.offload.connector import OffloadPlan

# A prefill this short is latency-bound (a cached request's question, a chat turn): with ``cache-aware`` it caps
# the cold prefill sharing its step. 64 tokens cost a CPU step little more than a decode, a GPU step nothing.
SHORT_PREFILL_TOKENS = 64
# Waiting requests whose rank ``cache-aware`` looks up again each step, stalest first (new ones are looked up when
# they come): a cached prompt's walk is one lookup a block, so a step's cost is bounded however long the queue.
REFRESH_PER_STEP = 64


@dataclass(slots=True)
class ScheduledChunk:
    """``num_new_tokens`` of ``request`` computed this step, starting at ``start``; ``block_ids[g]`` is its
    block table in KV cache group ``g`` (the null block's id where a sliding group holds nothing; empty for
    the recurrent-state group). ``state`` is a recurrent model's state work: the working slot, its zeroing or
    restore from a checkpoint before the forward pass, the checkpoints saved during it."""

    request: EngineRequest
    start: int
    num_new_tokens: int
    block_ids: list[list[int]]
    state: StateWork | None = None

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the request's tokens, so the next token is sampled."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """A step's work; ``copies`` (sub-block hits) must be done before the forward pass, ``offload`` (the
    offload tiers' loads and saves) around it."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[EngineRequest] = field(default_factory=list)
    copies: list[CopyOp] = field(default_factory=list)
    offload: OffloadPlan | None = None


class Scheduler:
    """Admits and grows requests through ``manager``, which finds their prefixes (device, sub-block copies,
    offload tiers) and owns their blocks; ``policy`` orders the waiting requests (see the module's doc)."""

    def __init__(
        self,
        manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        *,
        short_prefill_tokens: int = SHORT_PREFILL_TOKENS,
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.short_prefill_tokens = short_prefill_tokens
        self.waiting = WaitingQueue()
        self.running: list[EngineRequest] = []
        self.num_preemptions = 0
        # cache-aware: the waiting requests in the order to look their uncached tokens up again in.
        self._stalest: deque[EngineRequest] = deque()

    def add_request(self, request: EngineRequest) -> None:
        self.waiting.append(request, self._look_up(request))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: EngineRequest, status: RequestStatus) -> None:
        """Remove a request wherever it is and give its blocks back."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.manager.free(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        candidates, short = self._candidates(out)
        num_seat_preemptions = len(out.preempted)
        # The cold prefill tokens this step may still take beside a short admission; None: no cap.
        cap = self.short_prefill_tokens if short else None
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            num_new = min(request.num_tokens - start, budget)
            if cap is not None and num_new > 1:  # a prefill chunk; decodes are never capped
                num_new = min(num_new, cap)
                if num_new == 0:
                    i += 1
                    continue
            if not self._allocate_or_preempt(request, num_new, out):
                break
            if cap is not None and num_new > 1:
                cap -= num_new
            out.chunks.append(self._chunk(request, start, num_new))
            budget -= num_new
            i += 1
        if len(out.preempted) == num_seat_preemptions:  # blocks ran out: admit nobody
            self._admit_waiting(out, budget, candidates, cap)
        out.copies, out.offload = self.manager.take_transfers()
        return out

    def _candidates(self, out: SchedulerOutput) -> tuple[list[EngineRequest], bool]:
        """The waiting requests that may take this step's free seats, in the order to try them, and whether one
        of them is short (``fcfs``: the queue's head, nothing looked up). ``cache-aware`` ranks them by their
        uncached tokens (:meth:`_looked_up`), and when every seat is taken and the first is short, gives it the
        seat of a cold running request (:meth:`_seat_for_short`)."""
        seats = self.max_num_seqs - len(self.running)
        if not self.waiting or (seats <= 0 and self.policy == "fcfs"):
            return [], False
        if self.policy == "fcfs":
            return [candidate.request for candidate in self.waiting.first(seats)], False
        self._refresh()
        chosen = self.waiting.first(max(seats, 1))
        if seats <= 0:
            first = chosen[0]
            if first.due or first.uncached > self.short_prefill_tokens or not self._seat_for_short(out):
                return [], False
        short = any(candidate.uncached <= self.short_prefill_tokens for candidate in chosen)
        return [candidate.request for candidate in chosen], short

    def _seat_for_short(self, out: SchedulerOutput) -> bool:
        """Preempt the newest running request that was admitted cold (more than ``short_prefill_tokens``
        uncached), was never preempted and has more than one token to go; True if one went. Its blocks stay
        cached and it goes back due, first for the next seat: a short request waits for a step, not for a cold
        request's whole generation, and no request loses its seat twice."""
        short = self.short_prefill_tokens
        for victim in reversed(self.running):
            cold = victim.num_prompt_tokens - (victim.num_cached_tokens or 0) > short
            if cold and not victim.num_preemptions and victim.num_output_tokens + 1 < victim.sampling_params.max_tokens:
                self.running.remove(victim)
                self._preempt(victim, out)
                return True
        return False

    def _refresh(self) -> None:
        """Look the ``REFRESH_PER_STEP`` stalest waiting requests' uncached tokens up again (each was looked up when
        it joined the queue). With that many waiting or fewer, every one is looked up each step; beyond, an estimate
        is at most ``len(waiting) / REFRESH_PER_STEP`` steps old, and admission takes the real hit anyway."""
        waiting, stalest = self.waiting, self._stalest
        refreshed = 0
        while stalest and refreshed < min(REFRESH_PER_STEP, len(waiting)):
            request = stalest.popleft()
            if request in waiting and request.status is RequestStatus.WAITING:
                waiting.set_uncached(request, self._look_up(request))
                refreshed += 1

    def _look_up(self, request: EngineRequest) -> int:
        """A request joining or waiting in the queue: its uncached tokens now, from the device hit
        (``KVCacheManager.device_hit_tokens``), and last in line to be looked up again (``cache-aware``); 0 with
        ``fcfs``, which ranks nobody (every request is then due: the queue's order)."""
        if self.policy != "cache-aware":
            return 0
        self._stalest.append(request)
        return request.num_tokens - self.manager.device_hit_tokens(request)

    def _allocate_or_preempt(self, request: EngineRequest, num_new: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running requests until ``request`` fits; False if it had to go itself."""
        while self.manager.allocate_slots(request, num_new) is None:
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _admit_waiting(
        self, out: SchedulerOutput, budget: int, candidates: list[EngineRequest], cap: int | None
    ) -> None:
        """Admit ``candidates`` in order until one does not fit; cold ones share ``cap`` tokens (None: no cap).
        Each admitted request passes over the older ones still waiting: they count its uncached tokens."""
        manager = self.manager
        for request in candidates:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            hit = manager.find_prefix(request)
            num_computed = hit.num_tokens
            uncached = request.num_tokens - num_computed
            num_new = min(uncached, budget)
            capped = cap is not None and uncached > self.short_prefill_tokens
            if capped:
                num_new = min(num_new, cap)
                if num_new == 0:
                    break
            if manager.allocate_slots(request, num_new, hit) is None:
                break
            if capped:
                cap -= num_new
            self.waiting.remove(request, passing=uncached)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, num_computed, num_new))
            budget -= num_new

    def _chunk(self, request: EngineRequest, start: int, num_new: int) -> ScheduledChunk:
        manager = self.manager
        return ScheduledChunk(request, start, num_new, manager.block_ids(request), manager.state_work(request))

    def _preempt(self, request: EngineRequest, out: SchedulerOutput) -> None:
        self.manager.free(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request, self._look_up(request))
        out.preempted.append(request)
