"""Retention rules: the engine's own retention directives, derived from what requests share.

A user's directive (:mod:`prefixcache.core.retention`) says which tokens to keep; a rule decides it from what the
cache manager sees: every block position a request reaches, hit or just filled, in prefix order. A rule expresses
itself only through the pool's priorities and TTLs (:meth:`BlockPool.retain`), so the eviction order, the retained
share and the expiry it relies on are the pool's, the same as for user directives.

``shared``: a block that at least ``min_requests`` distinct requests reached is kept at ``priority`` (above the
default) for a TTL after its last use, then falls back to the default priority. Reaches are counted by block hash
across evictions, in a record of the ``history_factor`` x pool-size most recently reached hashes, so a prefix
evicted and computed again still counts as shared. Why this signal: on the Mooncake traces a block reached by one
request is reached again by 24% (conversation) and 42% (synthetic), by two requests 42% and 84%
(docs/eviction.md).

The TTL is ``max(ttl_s, horizon_factor x horizon)``, clamped to the operator's largest TTL. The *horizon* is how long
a block at the default priority survives once freed, learned from the stream: whenever a block the record saw
reached once is reached again after ``t`` seconds, it was either still cached (the horizon is at least ``t``) or
computed again (at most ``t``), and the estimate moves a step towards ``t`` when it disagrees. Why a TTL: a prefix
shared long ago is not protected forever against fresh ones; why tied to the horizon: a TTL's end sends a block
*first* (before the default blocks), so one shorter than the horizon evicts shared blocks ahead of unshared ones
younger than them, and one much longer fills a large cache with stale prefixes (docs/eviction.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from prefixcache.core.retention import DEFAULT_MAX_RETENTION_TTL_S, DEFAULT_PRIORITY, MAX_PRIORITY

if TYPE_CHECKING:
    from prefixcache.core.block_pool import Block, BlockPool
    from prefixcache.core.hashing import BlockHash


class RetentionRule(Protocol):
    """Decides blocks' retention from the requests that reach them; told by the cache manager."""

    def reached(self, positions: Iterable[tuple[BlockHash, list[Block]]], tenant: str | None, cached: bool) -> None:
        """One request (of ``tenant``) reached these block positions, each the position's hash and its blocks, one a
        KV cache group, all in use: ``cached``, its hits at admission (found in the cache), else blocks it fills;
        each position is reported once a request."""

    def clear(self) -> None:
        """The prefix cache was reset: forget what was shared."""


class SharedPrefixRetention:
    """The ``shared`` rule (see the module's docstring): blocks reached by ``min_requests`` or more requests go up
    to ``priority`` for ``max(ttl_s, horizon_factor x horizon)`` seconds after their last use (at most
    ``max_ttl_s``).

    Only blocks at the default priority are raised: a user's directive (higher or lower) is left as it is. A mark
    is the reaching request's tenant's (tenants' blocks are salted apart, so only its own requests reach them): it
    counts in that tenant's quota, and the tenant's own directives replace it. The record of reaches holds
    ``history_factor`` times the pool's blocks, least recently reached dropped first; each reach is O(1).
    """

    MIN_REQUESTS = 2
    PRIORITY = 60
    TTL_S = 300.0
    HORIZON_FACTOR = 3.0
    HORIZON_STEP = 0.1
    HISTORY_FACTOR = 4

    def __init__(
        self,
        pool: BlockPool,
        max_ttl_s: float = DEFAULT_MAX_RETENTION_TTL_S,
        min_requests: int = MIN_REQUESTS,
        priority: int = PRIORITY,
        ttl_s: float = TTL_S,
        horizon_factor: float = HORIZON_FACTOR,
        history_factor: int = HISTORY_FACTOR,
    ) -> None:
        if min_requests < 2:
            raise ValueError(f"min_requests must be at least 2 (shared by more than one request), got {min_requests}")
        if not DEFAULT_PRIORITY < priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be in ({DEFAULT_PRIORITY}, {MAX_PRIORITY}], got {priority}")
        if not ttl_s > 0 or not max_ttl_s > 0:
            raise ValueError(f"ttl_s and max_ttl_s must be positive, got {ttl_s} and {max_ttl_s}")
        if not horizon_factor >= 0:
            raise ValueError(f"horizon_factor must be >= 0, got {horizon_factor}")
        if history_factor < 1:
            raise ValueError(f"history_factor must be at least 1, got {history_factor}")
        self.pool = pool
        self.max_ttl_s = max_ttl_s
        self.min_requests = min_requests
        self.priority = priority
        self.ttl_s = ttl_s
        self.horizon_factor = horizon_factor
        self.history_size = history_factor * pool.num_usable_blocks
        self.horizon_s = 0.0  # learned: how long a freed block at the default priority stays cached
        # hash -> [requests that reached it, when the last one did]
        self._reaches: OrderedDict[BlockHash, list[float]] = OrderedDict()

    def reached(self, positions: Iterable[tuple[BlockHash, list[Block]]], tenant: str | None, cached: bool) -> None:
        reaches = self._reaches
        now = self.pool.clock()
        horizon, step = self.horizon_s, self.HORIZON_STEP
        shared: list[Block] = []
        for block_hash, blocks in positions:
            reach = reaches.pop(block_hash, None)
            if reach is None:
                reach = [1, now]
            else:
                if reach[0] == 1:  # left at the default priority since its one reach: did it survive?
                    elapsed = now - reach[1]
                    if (cached and elapsed > horizon) or (not cached and elapsed < horizon):
                        horizon += step * (elapsed - horizon)  # survived longer, or lost sooner, than estimated
                reach[0] += 1
                reach[1] = now
            reaches[block_hash] = reach
            if reach[0] >= self.min_requests:
                shared.extend(block for block in blocks if block.priority == DEFAULT_PRIORITY)
        self.horizon_s = horizon
        while len(reaches) > self.history_size:
            reaches.popitem(last=False)
        if shared:
            shared.reverse()  # marked tail first, as blocks are freed: within the retained share the head goes last
            self.pool.retain(shared, self.priority, self.ttl(), tenant)

    def ttl(self) -> float:
        """The TTL a block raised now gets: the floor, or a multiple of the learned horizon, within the largest."""
        return min(max(self.ttl_s, self.horizon_factor * self.horizon_s), self.max_ttl_s)

    def reach_count(self, block_hash: BlockHash) -> int:
        """How many requests reached ``block_hash`` as far as the record remembers (0: never, or forgotten)."""
        reach = self._reaches.get(block_hash)
        return 0 if reach is None else int(reach[0])

    def clear(self) -> None:
        self._reaches.clear()
        self.horizon_s = 0.0


RETENTION_RULES: dict[str, Callable[[BlockPool, float], RetentionRule]] = {"shared": SharedPrefixRetention}


def make_retention_rule(name: str, pool: BlockPool, max_ttl_s: float = DEFAULT_MAX_RETENTION_TTL_S) -> RetentionRule:
    """The registered rule ``name`` over ``pool``, its TTLs at most ``max_ttl_s`` (the operator's largest)."""
    try:
        factory = RETENTION_RULES[name]
    except KeyError:
        raise ValueError(f"unknown retention rule {name!r}; choose one of {', '.join(RETENTION_RULES)}") from None
    return factory(pool, max_ttl_s)
