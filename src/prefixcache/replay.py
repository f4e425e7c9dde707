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
    connector plan after each admission (a simulation stands in for the worker there).
    """

    def __init__(
        self,
        manager: KVCacheManager,
        cost: CostModel = CostModel(),
        in_flight: int | None = None,
        on_transfers: Callable[[Any], None] | None = None,
    ) -> None:
        if in_flight is not None and in_flight <= 0:
            raise ValueError(f"in_flight must be positive, got {in_flight}")
        self.manager = manager
        self.cost = cost
        self.in_flight = in_flight
        self.on_transfers = on_transfers
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
            if manager.allocate_slots(request, num_new, hit, output_length) is not None:
                break
            if not self._in_flight:
                raise ValueError(
                    f"request {index} needs {manager.peak_blocks(request.num_tokens + output_length, num_new)}"
                    f" blocks, more than the capacity of {manager.num_usable_blocks}"
                )
            self.now = max(self.now, self._in_flight[0][0])
            self._release()
        _, plan = manager.take_transfers()
        if plan is not None and self.on_transfers is not None:
            self.on_transfers(plan)
        duration = self.in_flight or self.cost.duration_ms(num_new, output_length)
        tokens = num_new + output_length
        heapq.heappush(self._in_flight, (self.now + duration, index, request, tokens))
        self.tokens_in_flight += tokens
        return hit.num_tokens

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
