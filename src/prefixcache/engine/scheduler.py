"""Continuous batching with chunked prefill, prefix-cache-aware admission and preemption by recompute.

Each step spends a token budget: running requests first (decodes and unfinished prefill chunks, in
arrival order), then waiting requests first come first served. A new request is charged only for
its uncached tokens. When blocks run out, the newest running request is preempted: its blocks are
freed (they stay cached, so it can hit them when it resumes) and it goes back to the front of the
queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prefixcache.core import KVCacheManager
from prefixcache.core.state_table import StateWork
from prefixcache.core.sub_block import CopyOp
from prefixcache.engine.request import EngineRequest, RequestStatus

if TYPE_CHECKING:
    from prefixcache.offload.connector import OffloadPlan


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
    offload tiers) and owns their blocks."""

    def __init__(self, manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.num_preemptions = 0

    def add_request(self, request: EngineRequest) -> None:
        self.waiting.append(request)

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
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            num_new = min(request.num_tokens - start, budget)
            if not self._allocate_or_preempt(request, num_new, out):
                break
            out.chunks.append(self._chunk(request, start, num_new))
            budget -= num_new
            i += 1
        if not out.preempted:
            self._admit_waiting(out, budget)
        out.copies, out.offload = self.manager.take_transfers()
        return out

    def _allocate_or_preempt(self, request: EngineRequest, num_new: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running requests until ``request`` fits; False if it had to go itself."""
        while self.manager.allocate_slots(request, num_new) is None:
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        manager = self.manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hit = manager.find_prefix(request)
            num_computed = hit.num_tokens
            num_new = min(request.num_tokens - num_computed, budget)
            if manager.allocate_slots(request, num_new, hit) is None:
                break
            self.waiting.popleft()
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
        self.waiting.appendleft(request)
        out.preempted.append(request)
