"""Why prompt tokens missed the prefix cache: the record of evicted hashes, the reasons, and a lookup result.

A missed prompt token has exactly one reason, so the reasons of a request add up to its prompt tokens
minus the tokens it reused (shared blocks plus sub-block copies):

``partial_block``
    Tokens from index ``(P - 1) // B * B`` on, for a prompt of ``P`` tokens in blocks of ``B``: after
    the last whole block a lookup may return. That is the tail that does not fill a block or, when the
    prompt ends on a block boundary, its whole last block, because the last prompt token is always
    computed (its logits are needed) and the cache is looked up by whole blocks. Between 1 and ``B``
    tokens a request, minus any of them a sub-block copy reused. No cache size helps; a shorter block
    size does.
``evicted``
    The hittable tokens after the cached prefix, when the first missing block's hash was evicted from
    the pool recently (it is in :class:`EvictedHashes`) under plain pressure: a larger cache would have
    served at least that block.
``expired``
    The same tokens when that block left the pool as an expired block: a retention directive's TTL had
    ended while it was free, so it went first. A longer TTL (or a request before it ended) would have
    served it.
``evicted_below_retained``
    The same tokens when that block was evicted at or below the default priority while free blocks above
    the default (retained by a directive) stayed: it was lost to retained blocks, so fewer or shorter
    directives, or a smaller ``max_retained_fraction``, would have kept it.
``new``
    The same tokens when that hash was not evicted recently: this prefix was never cached, was
    evicted longer ago than the record reaches, or was dropped by a reset (a reset is not an
    eviction: a larger cache would not have kept it).
``skipped``
    Every prompt token of a request that does not read the cache (prefix caching off, or prompt
    logprobs asked for, which need every position computed).
``no_checkpoint``
    A model with recurrent layers: the hittable tokens right after the hit that every attention group
    holds, lost only because the recurrent state has no checkpoint where this prompt parts from the cached
    path (``PrefixLookup.no_checkpoint_tokens``). A checkpoint there would have saved them; admitting the
    request leaves one (a junction). The hittable tokens after those are ``evicted`` or ``new`` by the first
    block the attention groups miss.

``prefixcache explain`` splits each reason finer (``explain/analysis.py``: ``REFINES``); summed by these
reasons, its counts are the ones defined here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixcache.core.block_pool import EVICTED, EVICTION_CAUSES, BlockPoolListener
from prefixcache.core.hashing import BlockHash

# The eviction reasons are the pool's eviction causes, by the same names.
MISS_REASONS = ("new", *EVICTION_CAUSES, "partial_block", "skipped")
MISS_REASONS += ("no_checkpoint",)  # a model with recurrent layers


class EvictedHashes(BlockPoolListener):
    """The block hashes the pool evicted lately (their last copy in some KV cache group reused), each with why it
    left (the pool's cause, one of :data:`~prefixcache.core.block_pool.EVICTION_CAUSES`): at least the last
    ``capacity``.

    Two generations of sets: new hashes go into the current one, which becomes the previous one (and
    the previous one is dropped) once it holds ``capacity`` hashes. So a hash is remembered for at least
    ``capacity`` and at most ``2 * capacity`` distinct evictions after its last, at one set insertion
    an eviction (an ordered dictionary costs three times that on the allocation path, a dictionary five).
    Beside each set, a dictionary holds the causes other than plain ``evicted`` of its hashes' latest
    eviction in that generation (empty while no directive is in play); a hash of the current set is read
    there, so a later plain eviction hides an earlier cause. Hashes cached again are left in place: a hash
    that is looked up and missing can only have left by a later eviction or a reset, so a stale entry
    never mislabels a miss. A reset clears the record (see the module docstring).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"the evicted-hash record's capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._current: set[BlockHash] = set()
        self._previous: set[BlockHash] = set()
        self._current_causes: dict[BlockHash, str] = {}
        self._previous_causes: dict[BlockHash, str] = {}

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._current or block_hash in self._previous

    def __len__(self) -> int:
        return len(self._current | self._previous)

    def __iter__(self):
        return iter(self._current | self._previous)

    def cause(self, block_hash: BlockHash) -> str | None:
        """Why ``block_hash`` was last evicted (its miss reason), None when the record does not hold it."""
        if block_hash in self._current:
            return self._current_causes.get(block_hash, EVICTED)
        if block_hash in self._previous:
            return self._previous_causes.get(block_hash, EVICTED)
        return None

    def blocks_evicted(self, block_hashes: list[BlockHash], group: int, causes: list[str] | None) -> None:
        if not self.capacity:
            return
        current, current_causes = self._current, self._current_causes
        current.update(block_hashes)
        if causes is not None:
            for block_hash, cause in zip(block_hashes, causes, strict=True):
                if cause == EVICTED:
                    current_causes.pop(block_hash, None)
                else:
                    current_causes[block_hash] = cause
        elif current_causes:  # evicted plainly now: an earlier cause of this generation no longer holds
            for block_hash in block_hashes:
                current_causes.pop(block_hash, None)
        if len(current) >= self.capacity:
            self._previous, self._current = current, set()
            self._previous_causes, self._current_causes = current_causes, {}

    def cache_cleared(self) -> None:
        self._current.clear()
        self._previous.clear()
        self._current_causes.clear()
        self._previous_causes.clear()


def hittable_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks a lookup may return for a prompt of ``num_tokens``: whole ones, leaving the last token to compute
    (its logits are needed). The manager, the offload tiers, the router and the simulators all cap by it."""
    return (num_tokens - 1) // block_size


def hittable_tokens(num_tokens: int, block_size: int) -> int:
    """Prompt tokens a block-granular lookup may return: :func:`hittable_blocks` in tokens."""
    return hittable_blocks(num_tokens, block_size) * block_size


def first_miss_reason(missed: dict[str, int]) -> str:
    """The reason of the first token computed: the hittable miss if any, else the partial block."""
    for reason in ("skipped", "no_checkpoint", "new", *EVICTION_CAUSES):
        if missed[reason]:
            return reason
    return "partial_block"


@dataclass(frozen=True, slots=True)
class RetentionRun:
    """Cached device tokens ``start`` .. ``end`` whose blocks share a retention: ``priority`` (35, the default,
    once a TTL ended), ``ttl_s`` (None at the default) and ``expires_in_s``, the seconds left while the blocks
    are free (None while a request uses one: a TTL runs from the last use)."""

    start: int
    end: int
    priority: int
    ttl_s: float | None = None
    expires_in_s: float | None = None


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    """What the cache holds of one prompt right now, as admitting it would find it.

    ``cached_tokens`` would not be computed (shared blocks, ``copied_tokens`` of them copied from a
    sub-block match, and blocks the offload tiers would load); ``cached_tokens_by_tier`` splits them
    between ``device`` and each tier (``CPU``, ``DISK``, ``REDIS``). They always form a prefix, so
    ``cached_prefix_end`` is the index of the first token to compute. ``missed_tokens`` has one entry per
    reason in ``MISS_REASONS``. ``retention`` describes the device's cached blocks of the prefix in runs of one
    retention (:class:`RetentionRun`).
    ``no_checkpoint_tokens`` (a model with recurrent layers): of the missed
    tokens, those every attention group holds right after the hit, lost only because the recurrent state
    has no checkpoint where this prompt parts from the cached path; a checkpoint there would have saved
    them (admitting the prompt leaves one, a junction). They are ``missed_tokens["no_checkpoint"]``.
    """

    prompt_tokens: int
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    cached_prefix_end: int
    copied_tokens: int
    block_size: int
    first_miss_reason: str
    missed_tokens: dict[str, int]
    retention: list[RetentionRun] = field(default_factory=list)
    no_checkpoint_tokens: int = 0
