"""Replaying requests through a real cache manager without a model: each admitted request holds its blocks
for a while, then frees them.

What the trace and routing simulations (``prefixcache bench trace|route``) and ``prefixcache explain``'s
replay share. It sits below both ``bench`` and ``explain`` and uses the manager's own admission calls, so
a replay finds, admits and evicts exactly as the engine's scheduler does.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefixcache.core import KVCacheManager, Request


@dataclass(frozen=True, slots=True)
class CostModel:
    """How long a request holds its blocks once started: prefill of the uncached prompt, then decode.

    Defaults: 20,000 prefill tokens/s and 20 ms per output token, one request's view of a busy server;
    cached tokens cost nothing, so better caching also shortens holding.
    """

    prefill_ms_per_token: float = 0.05
    decode_ms_per_token: float = 20.0

    def duration_ms(self, uncached_tokens: int, output_tokens: int) -> float:
        return self.prefill_ms_per_token * uncached_tokens + self.decode_ms_per_token * output_tokens


class ReplayClock:
    """A replay's clock in seconds, for the pool's TTLs: the ``now`` (milliseconds) of the :class:`HeldCache` it
    follows, 0 before it follows one. The manager is built before the cache that holds it, so it is handed this."""

    def __init__(self) -> None:
        self._cache: HeldCache | None = None

    def follow(self, cache: HeldCache) -> None:
        self._cache = cache

    def __call__(self) -> float:
        return 0.0 if self._cache is None else self._cache.now / 1000.0


class HeldCache:
    """One manager under a holding rule: an admitted request keeps its blocks until its finish time.

    A request is held for ``cost``'s duration of its uncached prompt and output, or, with ``in_flight=N``,
    for N time units (a replay whose clock counts requests then holds each until N later ones arrived).
    The cache has its own clock: a request that finds no room waits for the earliest finish, and so does
    everything behind it on this cache. ``tokens_in_flight`` sums the uncached prompt and output tokens of
    the admitted requests, the work a router sees queued there. ``on_transfers`` gets the manager's
    connector plan after each step (a simulation stands in for the worker there).

    ``max_chunk_tokens`` (None: the whole prompt in one step) prefills in chunks of at most that many tokens, one
    step each, as the engine's scheduler does with its ``max_num_batched_tokens`` for a request running alone:
    where a recurrent model's state checkpoints go depends on where its steps end.
    """

    def __init__(
        self,
        manager: KVCacheManager,
        cost: CostModel = CostModel(),
        in_flight: int | None = None,
        on_transfers: Callable[[Any], None] | None = None,
        max_chunk_tokens: int | None = None,
    ) -> None:
        if in_flight is not None and in_flight <= 0:
            raise ValueError(f"in_flight must be positive, got {in_flight}")
        if max_chunk_tokens is not None and max_chunk_tokens <= 0:
            raise ValueError(f"max_chunk_tokens must be positive, got {max_chunk_tokens}")
        self.manager = manager
        self.cost = cost
        self.in_flight = in_flight
        self.on_transfers = on_transfers
        self.max_chunk_tokens = max_chunk_tokens
        self.now = 0.0
        self.tokens_in_flight = 0
        self._in_flight: list[tuple[float, int, Request, int]] = []  # (finish time, index, request, tokens)

    def advance(self, now: float) -> None:
        """Move the clock to ``now`` (never back) and free every request finished by then, each at its finish time
        (a TTL starts when its blocks are freed)."""
        while self._in_flight and self._in_flight[0][0] <= now:
            self.now = max(self.now, self._in_flight[0][0])
            self._release()
        self.now = max(self.now, now)

    def admit(self, index: int, request: Request, output_length: int) -> int:
        """Look ``request`` up and admit it with room for ``output_length`` more tokens, waiting as needed.

        Returns its cached prompt tokens; raises ValueError for a request larger than the whole cache.
        """
        manager = self.manager
        while True:
            hit = manager.find_prefix(request)
            num_new = request.num_tokens - hit.num_tokens
            lookahead = self._lookahead(num_new, output_length)
            if manager.allocate_slots(request, self._chunk(num_new), hit, lookahead) is not None:
                break
            self._wait_for_room(index, request, num_new, output_length)
        self._step_done()
        while request.num_computed_tokens < request.num_tokens:
            left = request.num_tokens - request.num_computed_tokens
            lookahead = self._lookahead(left, output_length)
            while manager.allocate_slots(request, self._chunk(left), None, lookahead) is None:
                self._wait_for_room(index, request, num_new, output_length)
            self._step_done()
        duration = self.in_flight or self.cost.duration_ms(num_new, output_length)
        tokens = num_new + output_length
        heapq.heappush(self._in_flight, (self.now + duration, index, request, tokens))
        self.tokens_in_flight += tokens
        return hit.num_tokens

    def _chunk(self, num_left: int) -> int:
        """The prompt tokens the next step computes."""
        return num_left if self.max_chunk_tokens is None else min(num_left, self.max_chunk_tokens)

    def _lookahead(self, num_left: int, output_length: int) -> int:
        """Room for the output, reserved with the prompt's last chunk."""
        return output_length if self._chunk(num_left) == num_left else 0

    def _wait_for_room(self, index: int, request: Request, num_new: int, output_length: int) -> None:
        """Free the earliest request in flight; ValueError (``request`` given back) when none is left to free."""
        if not self._in_flight:
            self.manager.free(request)
            chunk = self._chunk(num_new)
            raise ValueError(
                f"request {index} needs {self.manager.peak_blocks(request.num_tokens + output_length, chunk)}"
                f" blocks, more than the capacity of {self.manager.num_usable_blocks}"
            )
        self.now = max(self.now, self._in_flight[0][0])
        self._release()

    def _step_done(self) -> None:
        """The step ran: its checkpoints become findable, its transfers go to ``on_transfers``."""
        _, plan = self.manager.take_transfers()
        if plan is not None and self.on_transfers is not None:
            self.on_transfers(plan)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def drain(self) -> None:
        """Free everything still in flight."""
        while self._in_flight:
            self._release()

    def _release(self) -> None:
        _, _, request, tokens = heapq.heappop(self._in_flight)
        self.manager.free(request)
        self.tokens_in_flight -= tokens
