"""Factories for core tests: small blocks (4 tokens) so block ids and eviction order are easy to state."""

import itertools

import pytest

from prefixcache.core import KVCacheManager, Request

BLOCK_SIZE = 4
_ids = itertools.count()


def make_request(tokens, request_id=None, **kwargs) -> Request:
    return Request(
        request_id=f"req-{next(_ids)}" if request_id is None else request_id,
        prompt_token_ids=list(tokens),
        **kwargs,
    )


def admit(manager: KVCacheManager, request: Request):
    """Look up and admit the whole prompt; returns the number of cached tokens."""
    blocks, num_cached = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_cached, num_cached, blocks)
    assert new is not None, "request did not fit"
    return num_cached


def unique_tokens(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture
def manager() -> KVCacheManager:
    return KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)


def manager_state(mgr: KVCacheManager):
    """Everything a lookup must leave alone: blocks, both free queues in order, the index, the eviction
    policy's own bookkeeping, block tables, stats, the evicted-hash record and the sub-block index."""
    pool = mgr.pool
    policy = {
        name: list(value.items()) if isinstance(value, dict) else value for name, value in vars(pool.evictable).items()
    }
    sub_blocks = None
    if mgr.sub_blocks is not None:
        sub_blocks = ({h: list(b) for h, b in mgr.sub_blocks.index.items()}, dict(mgr.sub_blocks.entries_of_block))
    return (
        [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.uncached_free],
        [b.block_id for b in pool.evictable],
        {h: (e.block_id if hasattr(e, "block_id") else tuple(e)) for h, e in pool.cached.items()},
        policy,
        {rid: [b.block_id for b in t] for rid, t in mgr._tables.items()},
        (mgr.stats.requests, mgr.stats.queries, mgr.stats.hits, mgr.stats.copied_tokens, dict(mgr.stats.missed_tokens)),
        list(mgr.evicted),
        sub_blocks,
    )
