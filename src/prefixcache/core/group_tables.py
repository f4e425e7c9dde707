"""One table object per attention KV cache group: how that kind of group admits, grows and frees a request's blocks.

The manager (:mod:`prefixcache.core.kv_cache_manager`) coordinates the groups: it decides the hit every group
agrees on, checks that a whole allocation fits before changing anything, and orders the frees across groups.
What differs by kind lives here, so a new kind is a new class rather than more branches in the manager (the hit
rule of each kind is :func:`~prefixcache.core.kv_cache_groups.longest_common_hit`'s, which a router shares):

- :class:`FullAttentionTable`: every block from the first stays in the request's table;
- :class:`SlidingWindowTable`: blocks wholly before the window are never held (the null block stands there) and
  are given back as the request advances.

The recurrent-state kind holds no blocks; its table is :class:`~prefixcache.core.state_table.StateTable`.
"""

from __future__ import annotations

from prefixcache.core.block_pool import Block, BlockPool
from prefixcache.core.kv_cache_groups import KVCacheGroupSpec


class FullAttentionTable:
    """A full-attention group: a hit needs every block from the first, and no block leaves before the request."""

    __slots__ = ("block_size", "null", "pool", "spec")

    def __init__(self, spec: KVCacheGroupSpec, pool: BlockPool, block_size: int) -> None:
        self.spec = spec
        self.pool = pool
        self.null = pool.null_block
        self.block_size = block_size

    def admission(
        self, held: list[Block], num_held: int, num_computed: int, num_needed: int
    ) -> tuple[list[Block], int]:
        """The table a request starts from (its first ``num_held`` hit blocks) and how many of its next positions,
        up to ``num_needed``, hold the null block instead of a new block: none here."""
        return held[:num_held], 0

    def leaving(self, table: list[Block], num_computed: int) -> list[int]:
        """Positions whose blocks the request no longer reads once ``num_computed`` tokens are computed, last
        first: none here."""
        return []

    def give_back(self, table: list[Block], positions: list[int]) -> None:
        """Free the blocks at ``positions`` (from :meth:`leaving`) and put the null block in their place."""
        self.pool.free_blocks([table[i] for i in positions])
        null = self.null
        for i in positions:
            table[i] = null


class SlidingWindowTable(FullAttentionTable):
    """A sliding-window group: the request holds no block wholly before the window of its next query. At admission
    the null block stands there (and for as many new positions); later those blocks are given back, which frees
    the ones no other request holds (to the cached free queue, hash kept)."""

    __slots__ = ()

    def admission(
        self, held: list[Block], num_held: int, num_computed: int, num_needed: int
    ) -> tuple[list[Block], int]:
        skip = self.spec.first_needed_block(num_computed, self.block_size)
        held_skip = min(skip, num_held)
        table = [self.null] * held_skip + held[held_skip:num_held] if held_skip else held[:num_held]
        return table, max(0, min(skip, num_needed) - num_held)

    def leaving(self, table: list[Block], num_computed: int) -> list[int]:
        """Positions before the first block the next query reads that still hold a block, last first (the
        earlier ones were given back already)."""
        null = self.null
        positions = []
        for i in range(self.spec.first_needed_block(num_computed, self.block_size) - 1, -1, -1):
            if table[i] is null:
                break
            positions.append(i)
        return positions


def make_table(spec: KVCacheGroupSpec, pool: BlockPool, block_size: int) -> FullAttentionTable:
    """The table object of an attention group's kind."""
    table_class = FullAttentionTable if spec.sliding_window is None else SlidingWindowTable
    return table_class(spec, pool, block_size)
