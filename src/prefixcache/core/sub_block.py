"""Sub-block prefix matching: reuse the part of a shared prefix that does not fill its last block.

With large blocks most of a shared prefix can sit in a partly matching block. Besides the full-block
hashes, every written block is also indexed by the chained hashes of its sub-block prefixes
``H(h_{k-1}, tokens[kB : kB + j*s], extra_keys_k)`` for ``j*s < B``: the same chain, extra keys and
salt. A lookup that ends at block ``k`` can then extend its hit by the longest sub-prefix some
written block shares; those tokens are *copied* into the request's own fresh block (the source is
shared and never written), and only the rest is computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixcache.core.block_pool import BlockPoolListener
from prefixcache.core.hashing import BlockHash, hash_block_tokens

if TYPE_CHECKING:
    from prefixcache.core.block_pool import Block
    from prefixcache.core.request import Request


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy the K/V of the first ``num_tokens`` slots of block ``src`` into block ``dst`` before the forward pass."""

    src: int
    dst: int
    num_tokens: int


class SubBlockIndex(BlockPoolListener):
    """Sub-prefix hash -> the blocks whose first tokens hold that sub-prefix's K/V.

    Entries are added only for K/V already written (``index_written``), for every sub-prefix of a
    block from its first token, and dropped when their block is reused. So a block that holds a
    sub-prefix of ``j`` sub-blocks is indexed under every shorter one too. Lookups return the first
    block indexed under a hash, like the full-block index.
    """

    def __init__(self, hash_algo: str, root_hash: BlockHash, block_size: int, sub_block_size: int) -> None:
        self.hash_algo = hash_algo
        self.root_hash = root_hash
        self.block_size = block_size
        self.sub_block_size = sub_block_size
        self.index: dict[BlockHash, dict[int, Block]] = {}
        self.entries_of_block: dict[int, list[BlockHash]] = {}

    def sub_prefix_hash(
        self, request: Request, block_hashes: list[BlockHash], block_index: int, num_tokens: int
    ) -> BlockHash:
        """The first ``num_tokens`` of block ``block_index``, chained on the full hash of the block before."""
        parent = block_hashes[block_index - 1] if block_index else self.root_hash
        start = block_index * self.block_size
        extra = request.block_extra_keys(block_index, self.block_size)
        return hash_block_tokens(self.hash_algo, parent, request.all_token_ids[start : start + num_tokens], extra)

    def lookup(
        self, request: Request, block_hashes: list[BlockHash], block_index: int, max_tokens: int
    ) -> tuple[Block, int] | None:
        """The longest indexed sub-prefix of block ``block_index`` of at most ``max_tokens`` tokens.

        If some block holds a sub-prefix of ``j`` sub-blocks it holds every shorter one, so a binary
        search over ``j`` needs about log2(B/s) hashes.
        """
        step = self.sub_block_size
        low, high = 0, min(max_tokens, self.block_size - step) // step
        best: tuple[Block, int] | None = None
        while low < high:
            mid = (low + high + 1) // 2
            holders = self.index.get(self.sub_prefix_hash(request, block_hashes, block_index, mid * step))
            if holders is None:
                high = mid - 1
            else:
                best, low = (next(iter(holders.values())), mid * step), mid
        return best

    def holds(
        self, block: Block, request: Request, block_hashes: list[BlockHash], block_index: int, num_tokens: int
    ) -> bool:
        """Whether ``block`` is still indexed under that sub-prefix (it may have been reused since a lookup)."""
        holders = self.index.get(self.sub_prefix_hash(request, block_hashes, block_index, num_tokens), {})
        return block.block_id in holders

    def index_written(
        self, request: Request, table: list[Block], block_hashes: list[BlockHash], start: int, end: int
    ) -> None:
        """Index the sub-prefixes ending in (start, end]: tokens whose K/V is now written."""
        step, size = self.sub_block_size, self.block_size
        for end_token in range((start // step + 1) * step, end + 1, step):
            if end_token % size == 0:
                continue  # a full block: the full-block index covers it
            k = end_token // size
            block = table[k]
            block_hash = self.sub_prefix_hash(request, block_hashes, k, end_token - k * size)
            self.index.setdefault(block_hash, {})[block.block_id] = block
            self.entries_of_block.setdefault(block.block_id, []).append(block_hash)

    def block_reused(self, block: Block, last_copy: bool) -> None:
        """The block is about to be overwritten: forget the sub-prefixes it held."""
        for block_hash in self.entries_of_block.pop(block.block_id, ()):
            holders = self.index[block_hash]
            del holders[block.block_id]
            if not holders:
                del self.index[block_hash]

    def cache_cleared(self) -> None:
        self.index.clear()
        self.entries_of_block.clear()

    def check_invariants(self) -> None:
        listed = 0
        for block_id, hashes in self.entries_of_block.items():
            for block_hash in hashes:
                assert block_id in self.index[block_hash], "a block lists a sub-block entry it is not under"
            listed += len(hashes)
        assert listed == sum(len(h) for h in self.index.values()), "a sub-block entry is not listed under its block"
