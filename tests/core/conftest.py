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
