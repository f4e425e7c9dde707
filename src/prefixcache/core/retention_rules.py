"""Retention rules: the engine's own retention directives, derived from what requests share.

A user's directive (:mod:`prefixcache.core.retention`) says which tokens to keep; a rule decides it from what the
cache manager sees: every block position a request reaches, hit or just filled, in prefix order. A rule expresses
itself only through the pool's priorities and TTLs (:meth:`BlockPool.retain`), so the eviction order, the retained
share and the expiry it relies on are the pool's, the same as for user directives.

``shared``: a block that at least ``min_requests`` distinct requests reached is kept at ``priority`` (above the
default) for ``ttl_s`` seconds after its last use (at most the operator's largest TTL), then falls back to the
default priority. Reaches are counted by
block hash across evictions, in a record of the ``history_factor`` x pool-size most recently reached hashes, so a
prefix evicted and computed again still counts as shared. Why this signal: on the Mooncake traces a block reached
by one request is reached again by 24% (conversation) and 42% (synthetic), by two requests 42% and 84%
(docs/eviction.md). Why a TTL: a prefix shared long ago is not protected forever against fresh ones.
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

    def reached(self, positions: Iterable[tuple[BlockHash, list[Block]]], tenant: str | None) -> None:
        """One request (of ``tenant``) reached these block positions (its hits at admission, then each block it
        fills), each the position's hash and its blocks, one a KV cache group, all in use; each position is
        reported once a request."""

    def clear(self) -> None:
        """The prefix cache was reset: forget what was shared."""


class SharedPrefixRetention:
    """The ``shared`` rule (see the module's docstring): blocks reached by ``min_requests`` or more requests go up
    to ``priority`` for ``ttl_s`` seconds after their last use (``max_ttl_s`` when that is shorter).

    Only blocks at the default priority are raised: a user's directive (higher or lower) is left as it is. A mark
    is the reaching request's tenant's (tenants' blocks are salted apart, so only its own requests reach them): it
    counts in that tenant's quota, and the tenant's own directives replace it. The record of reach counts holds
    ``history_factor`` times the pool's blocks, least recently reached dropped first; each reach is O(1).
    """

    MIN_REQUESTS = 2
    PRIORITY = 60
    TTL_S = 600.0
    HISTORY_FACTOR = 4

    def __init__(
        self,
        pool: BlockPool,
        max_ttl_s: float = DEFAULT_MAX_RETENTION_TTL_S,
        min_requests: int = MIN_REQUESTS,
        priority: int = PRIORITY,
        ttl_s: float = TTL_S,
        history_factor: int = HISTORY_FACTOR,
    ) -> None:
        if min_requests < 2:
            raise ValueError(f"min_requests must be at least 2 (shared by more than one request), got {min_requests}")
        if not DEFAULT_PRIORITY < priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be in ({DEFAULT_PRIORITY}, {MAX_PRIORITY}], got {priority}")
        if not ttl_s > 0 or not max_ttl_s > 0:
            raise ValueError(f"ttl_s and max_ttl_s must be positive, got {ttl_s} and {max_ttl_s}")
        if history_factor < 1:
            raise ValueError(f"history_factor must be at least 1, got {history_factor}")
        self.pool = pool
        self.min_requests = min_requests
        self.priority = priority
        self.ttl_s = min(ttl_s, max_ttl_s)
        self.history_size = history_factor * pool.num_usable_blocks
        self._reaches: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> requests that reached it

    def reached(self, positions: Iterable[tuple[BlockHash, list[Block]]], tenant: str | None) -> None:
        reaches = self._reaches
        min_requests = self.min_requests
        shared: list[Block] = []
        for block_hash, blocks in positions:
            count = reaches.get(block_hash)
            if count is None:  # a first reach: nothing to raise yet
                reaches[block_hash] = 1
                continue
            reaches.move_to_end(block_hash)
            reaches[block_hash] = count = count + 1
            if count >= min_requests:
                shared.extend(block for block in blocks if block.priority == DEFAULT_PRIORITY)
        while len(reaches) > self.history_size:
            reaches.popitem(last=False)
        if shared:
            shared.reverse()  # marked tail first, as blocks are freed: within the retained share the head goes last
            self.pool.retain(shared, self.priority, self.ttl_s, tenant)

    def reach_count(self, block_hash: BlockHash) -> int:
        """How many requests reached ``block_hash`` as far as the record remembers (0: never, or forgotten)."""
        return self._reaches.get(block_hash, 0)

    def clear(self) -> None:
        self._reaches.clear()


RETENTION_RULES: dict[str, Callable[[BlockPool, float], RetentionRule]] = {"shared": SharedPrefixRetention}


def make_retention_rule(name: str, pool: BlockPool, max_ttl_s: float = DEFAULT_MAX_RETENTION_TTL_S) -> RetentionRule:
    """The registered rule ``name`` over ``pool``, its TTLs at most ``max_ttl_s`` (the operator's largest)."""
    try:
        factory = RETENTION_RULES[name]
    except KeyError:
        raise ValueError(f"unknown retention rule {name!r}; choose one of {', '.join(RETENTION_RULES)}") from None
    return factory(pool, max_ttl_s)
