"""The scheduler's waiting queue, which gives the first ``k`` in the policy's order in O(k log n).

The order (the scheduler's module doc says why): *due* requests first in queue order, then the others by their
uncached tokens, ties in queue order. A request is due when it was preempted, or when the uncached tokens of the
requests admitted from behind it (its *passed* tokens) reach its own uncached tokens. Every admission passes all
the requests ahead of it, so a list scan would cost O(n) per admission and per step; here:

- *Queue order* is a number per request, ``seq``: arrivals take increasing numbers at the back, preempted
  requests decreasing negative ones at the front, and taking a request out moves nobody, so ``seq`` orders the
  queue as a deque would (every front number is below every back one).
- A *segment tree* over slots in ``seq`` order holds each request's *slack*, its uncached tokens minus its passed
  tokens (minus infinity once preempted: always due; plus infinity for an empty slot). An admission adds
  ``-uncached`` to the slots ahead of the admitted one (a prefix: O(log n) nodes, the adds kept on the nodes),
  and each node keeps its subtree's least slack, so the due requests (slack <= 0) come out leftmost first,
  O(log n) each, pruning every subtree whose least slack is positive. A request's passed tokens are the adds on
  its path since it took its slot.
- A *heap* of ``(uncached, seq)`` holds the requests that are not due, each with a version: a new estimate
  pushes a new item and makes the old one stale, a stale item is dropped when it comes up. Why no item goes
  wrong between estimates: passed tokens only grow, so without a new estimate a request only goes from not due
  to due, never back. A request that is not due always has its one current item, at its current estimate; an
  item whose request has become due is dropped when it comes up (its request is among the due ones already
  listed, since the heap is read only when fewer than ``k`` are due) and a new estimate pushes a new item if it
  is no longer due. So the current items of the requests that are not due pop in exactly ``(uncached, seq)``
  order.

Slots are never reused: when one end runs out, the tree is rebuilt around the requests still waiting with room
for as many again on each side, O(n) once per at least n insertions; the heap is rebuilt from its current items
once stale ones outnumber them. Both are amortized O(1) an insertion.

``fcfs`` uses the same queue with every estimate 0: every request is due, so the order is the queue's.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple

from prefixcache.engine.request import EngineRequest

_INF = float("inf")
_MIN_CAPACITY = 16


@dataclass(slots=True, eq=False)
class _Entry:
    request: EngineRequest
    seq: int  # queue order
    slot: int  # its leaf in the tree, in ``seq`` order too (a rebuild moves it)
    uncached: int
    preempted: bool
    offset: int = 0  # its passed tokens are ``offset`` minus the sum of the adds on its slot's path now
    version: int | None = None  # of the entry's current heap item; None: it has none (due, or out of the queue)


class Candidate(NamedTuple):
    """One of the first requests in the queue's order, with its uncached tokens as last estimated and whether it
    is due."""

    request: EngineRequest
    uncached: int
    due: bool


class WaitingQueue:
    """The waiting requests; ``uncached`` is each one's estimate of the tokens it would compute (0 for ``fcfs``)."""

    def __init__(self) -> None:
        self._entries: dict[EngineRequest, _Entry] = {}
        self._heap: list[tuple[int, int, int, _Entry]] = []
        self._versions = 0
        self._front_seq = 0
        self._back_seq = 0
        self._build([], [])

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request: object) -> bool:
        return request in self._entries

    def __iter__(self) -> Iterator[EngineRequest]:
        """In queue order (it sorts: for inspection, not for a step)."""
        return (entry.request for entry in self._ordered())

    def append(self, request: EngineRequest, uncached: int) -> None:
        """A new arrival, last in queue order."""
        if self._next_back == self._capacity:
            self._rebuild()
        self._back_seq += 1
        self._insert(_Entry(request, self._back_seq, self._next_back, uncached, preempted=False))
        self._next_back += 1

    def appendleft(self, request: EngineRequest, uncached: int) -> None:
        """A preempted request, first in queue order and due while it waits."""
        if self._next_front < 0:
            self._rebuild()
        self._front_seq -= 1
        self._insert(_Entry(request, self._front_seq, self._next_front, uncached, preempted=True))
        self._next_front -= 1

    def remove(self, request: EngineRequest, passing: int = 0) -> None:
        """Take ``request`` out; each request ahead of it counts ``passing`` more passed tokens (``request`` was
        admitted with that many uncached)."""
        entry = self._entries.pop(request)
        entry.version = None
        if passing:
            self._add_to_prefix(entry.slot, -passing)
        self._slots[entry.slot] = None
        leaf = self._capacity + entry.slot
        self._min[leaf] = _INF
        self._pull(leaf)

    def set_uncached(self, request: EngineRequest, uncached: int) -> None:
        """A new estimate of ``request``'s uncached tokens."""
        entry = self._entries[request]
        if uncached != entry.uncached:
            entry.uncached = uncached
            self._place(entry)

    def passed_tokens(self, request: EngineRequest) -> int:
        """The uncached tokens of the requests admitted from behind ``request`` since it joined the queue."""
        return self._passed(self._entries[request])

    def first(self, k: int) -> list[Candidate]:
        """The first ``k`` requests (all, if fewer wait) in the queue's order: the due ones in queue order, then the
        others by ``(uncached, seq)``."""
        chosen = [Candidate(entry.request, entry.uncached, True) for entry in self._leftmost_due(k)]
        heap, popped = self._heap, []
        while heap and len(chosen) < k:
            item = heapq.heappop(heap)
            entry = item[3]
            if entry.version != item[2]:
                continue  # stale
            if self._slack(entry) <= 0:
                entry.version = None  # due, so listed already; only a new estimate can make it not due again
                continue
            popped.append(item)
            chosen.append(Candidate(entry.request, entry.uncached, False))
        for item in popped:
            heapq.heappush(heap, item)
        return chosen

    def _insert(self, entry: _Entry) -> None:
        self._entries[entry.request] = entry
        self._slots[entry.slot] = entry
        entry.offset = self._path_sum(entry.slot)
        self._place(entry)

    def _place(self, entry: _Entry) -> None:
        """Write ``entry``'s slack into its leaf, and give it a current heap item if it is not due."""
        leaf = self._capacity + entry.slot
        self._min[leaf] = self._base(entry) + self._add[leaf]
        self._pull(leaf)
        if self._slack(entry) <= 0:
            entry.version = None
            return
        self._versions += 1
        entry.version = self._versions
        heapq.heappush(self._heap, (entry.uncached, entry.seq, entry.version, entry))
        if len(self._heap) > 2 * len(self._entries) + _MIN_CAPACITY:
            self._heap = [item for item in self._heap if item[3].version == item[2]]
            heapq.heapify(self._heap)

    def _ordered(self) -> list[_Entry]:
        return sorted(self._entries.values(), key=attrgetter("seq"))

    # The tree: slot ``s`` is leaf ``capacity + s``. A node's ``_add`` applies to every slot below it (the leaf's
    # own included); its ``_min`` is the least slack below it counting the adds at the node and below, so a slot's
    # slack is its base (``_base``) plus the adds on its whole path, and a subtree's least slack is its root's
    # ``_min`` plus the adds of the root's ancestors.

    def _base(self, entry: _Entry) -> float:
        return -_INF if entry.preempted else entry.uncached - entry.offset

    def _path_sum(self, slot: int) -> int:
        node, total, add = self._capacity + slot, 0, self._add
        while node:
            total += add[node]
            node >>= 1
        return total

    def _passed(self, entry: _Entry) -> int:
        return entry.offset - self._path_sum(entry.slot)

    def _slack(self, entry: _Entry) -> float:
        return self._base(entry) + self._path_sum(entry.slot)

    def _pull(self, leaf: int) -> None:
        mins, add = self._min, self._add
        node = leaf >> 1
        while node:
            mins[node] = min(mins[2 * node], mins[2 * node + 1]) + add[node]
            node >>= 1

    def _add_to_prefix(self, end: int, delta: int) -> None:
        """Add ``delta`` to the slack of slots ``[0, end)``: O(log n) nodes, then their ancestors' minima."""
        if end == 0:
            return
        mins, add = self._min, self._add
        lo, hi = self._capacity, self._capacity + end
        while lo < hi:
            if lo & 1:
                mins[lo] += delta
                add[lo] += delta
                lo += 1
            if hi & 1:
                hi -= 1
                mins[hi] += delta
                add[hi] += delta
            lo >>= 1
            hi >>= 1
        self._pull(self._capacity)
        self._pull(self._capacity + end - 1)

    def _leftmost_due(self, k: int) -> list[_Entry]:
        """The first ``k`` slots (in slot order, which is queue order) whose slack is at most 0."""
        capacity, mins, add, slots = self._capacity, self._min, self._add, self._slots
        found: list[_Entry] = []
        stack = [(1, 0)]  # a node and the adds of its ancestors
        while stack and len(found) < k:
            node, above = stack.pop()
            if mins[node] + above > 0:
                continue
            if node >= capacity:
                entry = slots[node - capacity]
                assert entry is not None  # an empty slot's slack is infinite
                found.append(entry)
                continue
            above += add[node]
            stack.append((2 * node + 1, above))
            stack.append((2 * node, above))
        return found

    def _rebuild(self) -> None:
        entries = self._ordered()
        self._build(entries, [self._passed(entry) for entry in entries])

    def _build(self, entries: list[_Entry], passed: list[int]) -> None:
        """A fresh tree holding ``entries`` (in queue order, with their passed tokens), with room for as many again
        and one more at either end."""
        capacity = _MIN_CAPACITY
        while capacity < 4 * (len(entries) + 1):
            capacity *= 2
        first = capacity // 2 - sum(entry.preempted for entry in entries)
        self._capacity = capacity
        self._next_front, self._next_back = first - 1, first + len(entries)
        self._min: list[float] = [_INF] * (2 * capacity)
        self._add: list[int] = [0] * (2 * capacity)
        self._slots: list[_Entry | None] = [None] * capacity
        for slot, (entry, num_passed) in enumerate(zip(entries, passed, strict=True), start=first):
            entry.slot, entry.offset = slot, num_passed  # the adds on every path are 0 in a fresh tree
            self._slots[slot] = entry
            self._min[capacity + slot] = self._base(entry)
        for node in range(capacity - 1, 0, -1):
            self._min[node] = min(self._min[2 * node], self._min[2 * node + 1])
