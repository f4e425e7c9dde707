"""Why prompt tokens missed the prefix cache: the record of evicted hashes, the reasons, and a lookup result.

A missed prompt token has exactly one reason, so the reasons of a request add up to its prompt tokens
minus the tokens it reused (shared blocks plus sub-block copies):

``partial_block``
    Tokens after the last block a lookup may return, ``(P - 1) // B * B`` for a prompt of ``P``
    tokens in blocks of ``B``: the tail that does not fill a block, or, when the prompt ends on a block
    boundary, its whole last block, because the last prompt token is always computed (its logits are
    needed) and the cache is looked up by whole blocks. Between 1 and ``B`` tokens a request, minus
    any of them a sub-block copy reused. No cache size helps; a shorter block size does.
``evicted``
    The hittable tokens after the cached prefix, when the first missing block's hash was evicted from
    the pool recently (it is in :class:`EvictedHashes`): a larger cache would have served at least
    that block.
``new``
    The same tokens when that hash was not evicted recently: this prefix was never cached, was
    evicted longer ago than the record reaches, or was dropped by a reset (a reset is not an
    eviction: a larger cache would not have kept it).
``skipped``
    Every prompt token of a request that does not read the cache (prefix caching off, or prompt
    logprobs asked for, which need every position computed).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from prefixcache.core.block_pool import BlockPoolListener
from prefixcache.core.hashing import BlockHash

MISS_REASONS = ("new", "evicted", "partial_block", "skipped")


class EvictedHashes(BlockPoolListener):
    """The last ``capacity`` block hashes the pool evicted (their last copy reused), oldest first.

    A hash evicted again moves to the newest end. Hashes cached again are left in place: a hash that
    is looked up and missing can only have left by a later eviction or a reset, so a stale entry never
    mislabels a miss; it only ages out. A reset clears the record (see the module docstring).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"the evicted-hash record's capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)

    def __iter__(self):
        return iter(self._hashes)

    def blocks_removed(self, block_hashes: list[BlockHash]) -> None:
        if not self.capacity:
            return
        hashes = self._hashes
        for block_hash in block_hashes:
            hashes[block_hash] = None
            hashes.move_to_end(block_hash)
        while len(hashes) > self.capacity:
            hashes.popitem(last=False)

    def cache_cleared(self) -> None:
        self._hashes.clear()


def hittable_tokens(num_tokens: int, block_size: int) -> int:
    """Prompt tokens a block-granular lookup may return: whole blocks, leaving the last token to compute."""
    return (num_tokens - 1) // block_size * block_size


def missed_tokens_by_reason(num_tokens: int, block_size: int, cached_end: int, evicted: bool) -> dict[str, int]:
    """Split the ``num_tokens - cached_end`` missed tokens of a prompt read from the cache.

    ``evicted`` tells whether the first missing block's hash was evicted recently; it is ignored when
    no hittable token was missed.
    """
    hittable_end = hittable_tokens(num_tokens, block_size)
    missed = dict.fromkeys(MISS_REASONS, 0)
    if cached_end < hittable_end:
        missed["evicted" if evicted else "new"] = hittable_end - cached_end
    missed["partial_block"] = num_tokens - max(cached_end, hittable_end)
    return missed


def first_miss_reason(missed: dict[str, int]) -> str:
    """The reason of the first token computed: the hittable miss if any, else the partial block."""
    for reason in ("skipped", "new", "evicted"):
        if missed[reason]:
            return reason
    return "partial_block"


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    """What the cache holds of one prompt right now, as admitting it would find it.

    The cached tokens always form a prefix, so ``cached_prefix_end`` is the index of the first token to
    compute. ``hit_tokens`` are in shared full blocks, ``copied_tokens`` would be copied from a sub-block
    match. ``missed_tokens`` has one entry per reason in ``MISS_REASONS``.
    """

    prompt_tokens: int
    cached_tokens: int
    cached_prefix_end: int
    hit_tokens: int
    copied_tokens: int
    block_size: int
    first_miss_reason: str
    missed_tokens: dict[str, int]
    prompt_token_ids: list[int] = field(repr=False)

    def to_dict(self, with_token_ids: bool = False) -> dict[str, Any]:
        data = asdict(self)
        if not with_token_ids:
            del data["prompt_token_ids"]
        return data
