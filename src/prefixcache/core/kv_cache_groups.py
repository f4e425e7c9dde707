"""KV cache groups: layers that share an attention spec, and the longest prefix every group can serve.

A model's layers are split into groups of layers with the same attention spec (full attention, or a
sliding window of ``W`` tokens). All groups share one block pool and the same block hashes (the same
tokens); each group has its own block table per request and its own cached block per hash. A model
with one spec (Llama, SmolLM2) has one group: the pool, block ids and eviction order of a plain
prefix cache.

What a group needs of a cached prefix that ends at block ``k`` (the next token to compute is at
``k * block_size``):

- full attention: every block from the first, ``0 .. k - 1``;
- a sliding window of ``W``: the query at position ``p`` reads the keys ``p - W + 1 .. p``, so only the
  blocks covering the ``W - 1`` positions before the hit point, ``cdiv(W - 1, block_size)`` blocks
  ending at ``k - 1`` (all of ``0 .. k - 1`` when fewer); blocks before them may be missing (holes);
- recurrent state (Gated DeltaNet, Mamba2, short convolutions): no per-token K/V, one fixed-size state per
  sequence, so a hit needs a *state checkpoint* taken exactly at block ``k`` (keyed by the hash of block
  ``k - 1``); a checkpoint at any other boundary is of no use for ``k``.

:func:`longest_common_hit` finds the longest prefix every group can serve, iterating until the groups
agree. It works on any ``lookup`` (a block pool's cached map, or a router's picture of a backend's
events), so an engine and a router that predicts the engine's hit use the same rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from prefixcache.core.hashing import BlockHash

T = TypeVar("T")

FULL_ATTENTION_KIND = "full_attention"
SLIDING_WINDOW_KIND = "sliding_window"
# vLLM's kind of a recurrent layer's group (``KVCacheSpecKind.MAMBA``, for every MambaSpec: Mamba2, GDN, short
# convolutions); its events carry no sliding window.
STATE_KIND = "mamba"
# vLLM's names of the attention specs whose hit follows one of the two block rules here, by whether the spec
# slides (MLA stores K/V compressed, and hits alike). Mamba is the state rule; other kinds (chunked local
# attention) keep their blocks otherwise.
_KINDS_SLIDE = {
    FULL_ATTENTION_KIND: False,
    "mla_attention": False,
    SLIDING_WINDOW_KIND: True,
    "sliding_window_mla": True,
}


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """What the cache manager needs of one KV cache group: its attention, or recurrent state.

    ``sliding_window`` None is full attention; else a query at position ``p`` sees the keys at positions
    ``p - sliding_window + 1 .. p`` (Hugging Face's convention, the window counts the query itself).
    ``recurrent_state``: the group of a model's recurrent layers, which keep one state per sequence and hit
    only at a state checkpoint (no window)."""

    sliding_window: int | None = None
    recurrent_state: bool = False

    def __post_init__(self) -> None:
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(f"sliding_window must be a positive integer or None, got {self.sliding_window!r}")
        if not isinstance(self.recurrent_state, bool):
            raise ValueError(f"recurrent_state must be a bool, got {self.recurrent_state!r}")
        if self.recurrent_state and self.sliding_window is not None:
            raise ValueError("a recurrent-state group has no sliding window")

    @property
    def kind(self) -> str:
        """vLLM's name of the spec, as KV cache events carry it (``kv_cache_spec_kind``)."""
        if self.recurrent_state:
            return STATE_KIND
        return FULL_ATTENTION_KIND if self.sliding_window is None else SLIDING_WINDOW_KIND

    def describe(self) -> str:
        if self.recurrent_state:
            return "recurrent state"
        return "full attention" if self.sliding_window is None else f"sliding window {self.sliding_window}"

    def window_blocks(self, block_size: int) -> int | None:
        """Blocks a hit must hold before its end: None for full attention (all of them) and for recurrent
        state (no blocks; a checkpoint at the end)."""
        if self.sliding_window is None:
            return None
        return -(-(self.sliding_window - 1) // block_size)

    def first_needed_block(self, num_computed_tokens: int, block_size: int) -> int:
        """The first block the next query (at position ``num_computed_tokens``) can read; the blocks before it
        lie wholly outside the window and are never read again. Always 0 for full attention."""
        if self.sliding_window is None:
            return 0
        return max(0, (num_computed_tokens - self.sliding_window + 1) // block_size)


FULL_ATTENTION = KVCacheGroupSpec()
RECURRENT_STATE = KVCacheGroupSpec(recurrent_state=True)


def spec_of_kind(kind: str, sliding_window: int | None) -> KVCacheGroupSpec | None:
    """The spec of a group described by vLLM's fields (a KV event's ``kv_cache_spec_kind`` and
    ``kv_cache_spec_sliding_window``, a server's ``kv_cache_groups``); None for a kind whose hit follows
    neither rule. A full-attention kind ignores the window (vLLM gives one to sliding layers it treats as
    full when its hybrid manager is off); ValueError for a sliding kind without a positive window."""
    if kind == STATE_KIND:
        return RECURRENT_STATE
    slides = _KINDS_SLIDE.get(kind)
    if slides is None:
        return None
    if not slides:
        return FULL_ATTENTION
    if sliding_window is None:
        raise ValueError(f"a {kind} group needs its sliding window")
    return KVCacheGroupSpec(sliding_window)


def check_groups(groups: Sequence[KVCacheGroupSpec]) -> tuple[KVCacheGroupSpec, ...]:
    """The groups as a tuple; ValueError when there are none, one is not a spec, or the recurrent-state group
    is not one, last, after at least one attention group (the attention groups keep their indexes)."""
    groups = tuple(groups)
    if not groups:
        raise ValueError("a KV cache needs at least one group")
    for group in groups:
        if not isinstance(group, KVCacheGroupSpec):
            raise ValueError(f"KV cache groups must be KVCacheGroupSpec, got {group!r}")
    states = [g for g, group in enumerate(groups) if group.recurrent_state]
    if states and (states != [len(groups) - 1] or len(groups) < 2):
        raise ValueError(
            "a KV cache has at most one recurrent-state group, last, after its attention groups; got "
            f"{', '.join(g.describe() for g in groups)}"
        )
    return groups


def check_sub_blocks(groups: Sequence[KVCacheGroupSpec], block_size: int, sub_block_size: int | None) -> None:
    """Sub-block prefix matching copies a partial block into one table; ValueError unless the cache is one
    full-attention group (a model with sliding-window layers needs the hybrid KV cache manager disabled)."""
    if sub_block_size is not None and sub_block_size < block_size and tuple(groups) != (FULL_ATTENTION,):
        raise ValueError(
            "sub-block prefix matching supports one full-attention KV cache group; this cache has "
            f"{len(groups)} group(s) ({', '.join(g.describe() for g in groups)}): turn sub-blocks off or disable "
            "the hybrid KV cache manager"
        )


def window_hit(
    lookup: Callable[[BlockHash], T | None], hashes: Sequence[BlockHash], max_blocks: int, window_blocks: int
) -> tuple[int, list[T]]:
    """The longest hit of at most ``max_blocks`` blocks a sliding-window group can serve: ``(k, found)`` where
    ``found`` are the blocks ``k - len(found) .. k - 1`` (the window before the hit point, or every block
    from the first when the hit is shorter than the window). Searches from the end, so a hole before the
    window does not matter."""
    if window_blocks == 0:
        return max_blocks, []
    found: list[T] = []
    for i in range(max_blocks - 1, -1, -1):
        block = lookup(hashes[i])
        if block is None:
            found.clear()
            continue
        found.append(block)
        if len(found) == window_blocks:
            found.reverse()
            return i + window_blocks, found
    found.reverse()
    return len(found), found


def state_hit(
    lookup: Callable[[BlockHash], T | None], hashes: Sequence[BlockHash], max_blocks: int
) -> tuple[int, list[T]]:
    """The longest hit of at most ``max_blocks`` blocks a recurrent-state group can serve: ``(k, [checkpoint])``
    for the deepest checkpoint at a boundary ``k <= max_blocks`` (keyed by the hash of block ``k - 1``), or
    ``(0, [])``: the state starts from zero."""
    for k in range(max_blocks, 0, -1):
        checkpoint = lookup(hashes[k - 1])
        if checkpoint is not None:
            return k, [checkpoint]
    return 0, []


def checkpoint_boundary(
    has_checkpoint: Callable[[BlockHash], bool], hashes: Sequence[BlockHash], floor: int, ceiling: int
) -> int:
    """The deepest boundary ``k`` with ``floor < k <= ceiling`` at which ``has_checkpoint`` finds a state
    checkpoint (keyed by the hash of block ``k - 1``), else ``floor``.

    How a hit of a model with recurrent layers reaches into its offload tiers: the attention groups hold the
    device's blocks up to their own hit and the tiers' run of blocks after it (``ceiling``), the device's common
    hit is ``floor``, and the hit ends at the deepest checkpoint (device or tier) in between. The cache manager
    admits by it and a router predicts the manager's hit by it."""
    for k in range(ceiling, floor, -1):
        if has_checkpoint(hashes[k - 1]):
            return k
    return floor


def full_hit(lookup: Callable[[BlockHash], T | None], hashes: Sequence[BlockHash], max_blocks: int) -> list[T]:
    """The run of blocks from the first that a full-attention group holds, at most ``max_blocks``."""
    found: list[T] = []
    for block_hash in hashes[:max_blocks]:
        block = lookup(block_hash)
        if block is None:
            break
        found.append(block)
    return found


def longest_common_hit(
    groups: Sequence[KVCacheGroupSpec],
    lookups: Sequence[Callable[[BlockHash], T | None]],
    hashes: Sequence[BlockHash],
    max_blocks: int,
    block_size: int,
) -> tuple[int, list[list[T]]]:
    """The longest prefix of at most ``max_blocks`` blocks that every group can serve, ``lookups[g]`` telling
    what group ``g`` holds: ``(k, found)``, ``found[g]`` being the blocks group ``g`` needs, the last
    ``len(found[g])`` of ``0 .. k - 1`` (all of them for full attention; the one checkpoint at ``k`` for
    recurrent state, none when ``k`` is 0).

    Full-attention groups go first (their hit bounds every other); a sliding-window group whose window
    before ``k`` has a hole lowers ``k`` to the next point whose window it holds, and a recurrent-state
    group lowers it to its deepest checkpoint at or below ``k``; either may break a sliding group's window,
    so the groups are asked again until none lowers ``k``. A full group's run from the first block stays
    valid when ``k`` drops, so it is only cut.
    """
    order = sorted(range(len(groups)), key=lambda g: groups[g].kind != FULL_ATTENTION_KIND)
    found: list[list[T] | None] = [None] * len(groups)
    ends = [0] * len(groups)
    k = max_blocks
    settled = False
    while not settled:
        settled = True
        for g in order:
            window = groups[g].window_blocks(block_size)
            if found[g] is not None and ends[g] == k:
                continue
            if groups[g].recurrent_state:
                ends[g], found[g] = state_hit(lookups[g], hashes, k)
            elif window is None:
                if found[g] is None:
                    found[g] = full_hit(lookups[g], hashes, k)
                found[g] = found[g][:k]
                ends[g] = len(found[g])
            else:
                ends[g], found[g] = window_hit(lookups[g], hashes, k, window)
            if ends[g] < k:
                k = ends[g]
                settled = False
    return k, found  # type: ignore[return-value]
