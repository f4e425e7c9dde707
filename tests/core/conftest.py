"""Factories for core tests: small blocks (4 tokens) so block ids and eviction order are easy to state."""

import dataclasses
import itertools

import pytest

from prefixcache.core import KVCacheManager, Request
from prefixcache.core.block_pool import BlockPoolListener

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
    hit = manager.find_prefix(request)
    new = manager.allocate_slots(request, request.num_tokens - hit.num_tokens, hit)
    assert new is not None, "request did not fit"
    return hit.num_tokens


class FakeConnector(BlockPoolListener):
    """A connector holding the hashes in ``held_hashes``: records what the manager asks it to load."""

    def __init__(self) -> None:
        self.held_hashes: set = set()
        self.loads: list[tuple[int, tuple]] = []
        self.finished: list[str] = []

    def _run(self, block_hashes, start, end) -> int:
        count = 0
        while start + count < end and block_hashes[start + count] in self.held_hashes:
            count += 1
        return count

    def extend_hit(self, request, block_hashes, start, end) -> int:
        return self._run(block_hashes, start, end)

    def held(self, request, block_hashes, start, end) -> dict[str, int]:
        return {"FAKE": self._run(block_hashes, start, end) * BLOCK_SIZE}

    def admitted(self, request, block_hashes, start, targets) -> None:
        self.loads.extend((start + i, target) for i, target in enumerate(targets))

    def request_finished(self, request) -> None:
        self.finished.append(request.request_id)

    def take_plan(self, cached_block_ids):
        return None


class FakeClock:
    """A clock for TTLs that moves only when a test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def unique_tokens(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture
def manager() -> KVCacheManager:
    return KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)


def manager_state(mgr: KVCacheManager):
    """Everything a lookup must leave alone: blocks (their retention too), the free queues in order, the index, the
    eviction policy's own bookkeeping, block tables, stats, the evicted-hash record and the sub-block index."""
    pool = mgr.pool
    policy = {
        name: list(value.items()) if isinstance(value, dict) else value for name, value in vars(pool.evictable).items()
    }
    sub_blocks = None
    if mgr.sub_blocks is not None:
        sub_blocks = ({h: list(b) for h, b in mgr.sub_blocks.index.items()}, dict(mgr.sub_blocks.entries_of_block))
    return (
        [(b.block_id, b.ref_cnt, b.block_hash, b.group, b.priority, b.tenant, b.expires_at) for b in pool.blocks],
        [b.block_id for b in pool.uncached_free],
        [b.block_id for b in pool.evictable],
        [b.block_id for b in pool.retained_free],
        list(pool.retained),
        [
            {h: (e.block_id if hasattr(e, "block_id") else tuple(e)) for h, e in cached.items()}
            for cached in pool.cached
        ],
        policy,
        {rid: [[b.block_id for b in t] for t in tables] for rid, tables in mgr._tables.items()},
        dataclasses.astuple(mgr.stats),
        list(mgr.evicted),
        sub_blocks,
    )
