"""Attention over a paged KV cache.

The cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``. A step
first writes the new tokens' K/V at ``slot_mapping`` (:func:`write_kv_cache`, or on CPU one call with the layer's
RoPE: the decoder's ``rotary_kv_write_``) and then every request attends to all of its keys, gathered block-wise
from its block table. Because all writes of a layer happen before any read, a request may read blocks that
another request of the same step is writing (a shared prefix being filled).

Requests are batched into a few :class:`AttentionGroup` s, each run as one padded
``scaled_dot_product_attention`` call (long query runs after cached context are split into chunks first).
Grouping, padding indices and the masks are computed once per step (:meth:`AttentionMetadata.build`; the
groups and masks lazily, on first use: a step of decodes takes :class:`DecodeAttention` and never builds them)
and shared by all layers. On a CPU with prefixcache's kernels (:func:`native_ops`), the
requests with more than one new token skip the groups: one ``paged_prefill_attention`` call a layer attends all
of them over their K/V where it lies in the cache (no gather, no padding, no mask), with a reduction order per
query that depends only on its keys, so a prompt's outputs are the same bit for bit however it was split into
cached and new tokens.

On CPU, where prefixcache's kernels are built (:func:`~prefixcache.model.native.native_ops`), requests that decode
one token (a decode step, and the one-query groups of a mixed step) skip the gather and the mask: the
``prefixcache::paged_decode_attention`` kernel reads each request's K/V rows in place through its block table.

Metadata built for a sliding window W (a KV cache group of sliding-window layers) gathers each query chunk's
keys from the block holding its first visible key (position q - W + 1) on: the blocks before it are never read,
so a cache may have freed them and put a null block in their place in the table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from prefixcache.model.cpu_linear import amx_tiles
from prefixcache.model.native import native_ops

# Per-group fixed cost in "query x key" units used when deciding whether two requests share one padded SDPA
# call: merging is allowed while the padded work grows by at most this much over running them separately.
_GROUP_CALL_COST = 2048
# Longest run of queries attended in one call when a request has earlier context (see _segments).
_QUERY_CHUNK = 512
# What the native decode kernel reads and writes (it sums in float32: a float64 model keeps torch's path).
_NATIVE_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))


@dataclass(slots=True)
class AttentionGroup:
    """Segments (whole requests or query chunks of one, see :func:`_segments`) attended in one SDPA call.

    Queries are laid out as ``[num_reqs, max_q]`` (one row of the layout per segment) and keys as
    ``num_blocks`` blocks of each segment's request gathered into ``[num_reqs, num_blocks * block_size]``,
    from its first block, or with a window from the block of its first visible key (``kv_start``); the mask
    hides padding, future keys and keys left of the window.
    """

    num_reqs: int
    max_q: int
    kv_len: int
    # [num_reqs, num_blocks] block ids to gather keys from.
    block_tables: torch.Tensor
    # [num_reqs, max_q] position of each query row; padding rows repeat the request's last position so that
    # they always see at least one key (no NaN) and their output is discarded anyway.
    q_pos: torch.Tensor
    # (start, end) when the group's tokens are contiguous batch rows that need no padding, else None.
    token_slice: tuple[int, int] | None
    # [num_group_tokens] batch rows of the group's tokens (None when token_slice is set).
    token_index: torch.Tensor | None
    # [num_group_tokens] their rows in the padded [num_reqs * max_q] layout (None when nothing is padded).
    pad_index: torch.Tensor | None
    # One request with no earlier tokens: its keys are exactly the new tokens, so no gather and a plain
    # causal mask (lets SDPA use its fastest kernels).
    fresh: bool
    # [num_reqs] position of each segment's first gathered key (a block start), or None when all are 0.
    kv_start: torch.Tensor | None
    # [num_reqs] keys of each segment in its gathered table (its last position + 1 - its kv_start): what the
    # native decode kernel reads of a one-query group.
    kv_lens: torch.Tensor
    # The longest distance from a gathered key to a query of its segment: a window longer than this hides
    # nothing, so its mask is the plain causal one.
    max_reach: int
    _masks: dict[tuple[int | None, torch.dtype], torch.Tensor | None] = field(default_factory=dict)

    def mask(self, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """Additive mask ``[num_reqs, 1, max_q, kv_len]`` (0 = attend, -inf = not); None means plain causal.

        Additive rather than boolean because SDPA's CPU kernels would convert a boolean mask in every layer
        (measurably slower for decode batches); built once per step and dtype, shared by the layers.
        """
        if sliding_window is not None and sliding_window > self.max_reach:
            sliding_window = None
        key = (sliding_window, dtype)
        if key not in self._masks:
            if self.fresh and sliding_window is None:
                self._masks[key] = None
            else:
                k_pos = torch.arange(self.kv_len, device=self.q_pos.device)
                if self.kv_start is not None:
                    k_pos = k_pos + self.kv_start[:, None, None]
                q_pos = self.q_pos[:, :, None]
                allowed = k_pos <= q_pos
                if sliding_window is not None:
                    allowed &= k_pos > q_pos - sliding_window
                additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
                self._masks[key] = additive.masked_fill_(~allowed, float("-inf"))[:, None]
        return self._masks[key]


@dataclass(slots=True)
class AttentionMetadata:
    """Everything the attention layers need about one step, built once and shared by all layers (the groups on
    first use: :attr:`groups`)."""

    # [T] cache slot (block_id * block_size + offset) where each new token's K/V is written.
    slot_mapping: torch.Tensor
    # [R, max_blocks] block table of each request, padded with 0, truncated to the blocks in use.
    block_tables: torch.Tensor
    # [R + 1] request r's new tokens are rows query_start_loc[r]:query_start_loc[r + 1].
    query_start_loc: torch.Tensor
    # [R] tokens of each request after this step (earlier + new).
    seq_lens: torch.Tensor
    # [T] position of each new token (what the model's ``positions`` argument should be).
    positions: torch.Tensor
    # [R] row of each request's last new token: the hidden states to compute logits from.
    last_token_indices: torch.Tensor
    num_tokens: int
    block_size: int
    # The longest request's tokens after this step (what the RoPE tables must cover).
    max_seq_len: int
    # Whether every request decodes one token (num_tokens == R).
    decodes_only: bool
    # Builds the groups (see :attr:`groups`) from the step's plain arrays, once.
    _plan_groups: Callable[[], tuple[AttentionGroup, ...]]
    # The window the gathers start at (see the module docstring); None: every key from position 0.
    sliding_window: int | None = None
    # [P] the requests prefixcache's prefill kernel attends where it runs (a CPU with prefixcache's kernels, a
    # float32 / bfloat16 / float16 cache): those with more than one new token, in one call a layer; the others
    # in ``beside_prefill`` (their groups). None: no kernel, or no such request. ``groups`` always hold every
    # request (torch's path, where a layer's dtype is not the kernel's).
    prefill_requests: torch.Tensor | None = None
    beside_prefill: tuple[AttentionGroup, ...] | None = None
    # Builds, once, the same prefill requests as torch's flash attention takes them (:class:`PrefillRuns`), for a
    # bfloat16 layer on a CPU with AMX tiles (:func:`_flash_on_amx`); None where ``prefill_requests`` is.
    plan_prefill_runs: Callable[[], PrefillRuns] | None = None
    _groups: tuple[AttentionGroup, ...] | None = None

    @property
    def groups(self) -> tuple[AttentionGroup, ...]:
        """Every request's segments in padded SDPA groups (see :class:`AttentionGroup`), built on first use: a
        step of decodes only runs :class:`DecodeAttention` instead (:meth:`decode_inputs`), which needs none."""
        if self._groups is None:
            self._groups = self._plan_groups()
        return self._groups

    @classmethod
    def build(
        cls,
        block_tables: Sequence[Sequence[int]],
        num_computed: Sequence[int],
        num_new: Sequence[int],
        block_size: int,
        device: torch.device | str,
        sliding_window: int | None = None,
    ) -> AttentionMetadata:
        """Build the metadata of a step from plain lists.

        For request r, tokens ``num_computed[r] .. num_computed[r] + num_new[r] - 1`` are new this step;
        its block table must cover all ``num_computed[r] + num_new[r]`` tokens (longer tables are fine).
        The new tokens of the batch are the requests' tokens concatenated in request order. With
        ``sliding_window`` only the layers of that window may use the metadata, and the table entries of blocks
        wholly before ``num_computed[r] - sliding_window + 1`` are never read.
        """
        num_reqs = len(block_tables)
        if num_reqs == 0 or len(num_computed) != num_reqs or len(num_new) != num_reqs:
            raise ValueError(
                f"need one entry per request and at least one request, got {num_reqs} block tables, "
                f"{len(num_computed)} num_computed, {len(num_new)} num_new"
            )
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        computed = np.asarray(num_computed, dtype=np.int64)
        new = np.asarray(num_new, dtype=np.int64)
        if (new < 1).any() or (computed < 0).any():
            raise ValueError("every request needs num_new >= 1 and num_computed >= 0")
        seq_lens = computed + new
        blocks_needed = -(-seq_lens // block_size)
        for r, table in enumerate(block_tables):
            if len(table) < blocks_needed[r]:
                raise ValueError(
                    f"request {r} has {seq_lens[r]} tokens, needing {blocks_needed[r]} blocks of "
                    f"{block_size}, but its block table has only {len(table)}"
                )
        tables = np.zeros((num_reqs, int(blocks_needed.max())), dtype=np.int64)
        for r, table in enumerate(block_tables):
            tables[r, : blocks_needed[r]] = table[: blocks_needed[r]]

        query_start = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(new, out=query_start[1:])
        num_tokens = int(query_start[-1])
        token_req = np.repeat(np.arange(num_reqs), new)
        positions = np.arange(num_tokens) - np.repeat(query_start[:-1] - computed, new)
        slots = tables[token_req, positions // block_size] * block_size + positions % block_size

        device = torch.device(device)

        def to_dev(a: np.ndarray) -> torch.Tensor:
            tensor = torch.from_numpy(np.ascontiguousarray(a))
            return tensor if tensor.device == device else tensor.to(device)

        @cache
        def segments() -> _Segments:  # only where groups are built: a step of decodes needs none
            return _Segments(computed, new, query_start, tables, block_size, sliding_window, to_dev)

        prefill_requests = beside_prefill = plan_prefill_runs = None
        prefill = new > 1
        if prefill.any() and device.type == "cpu" and _prefill_kernel() is not None:
            prefill_rows = np.flatnonzero(prefill)
            prefill_requests = to_dev(prefill_rows)
            others = np.flatnonzero(~prefill[segments().req])
            beside_prefill = segments().groups(others) if len(others) else ()
            plan_prefill_runs = cache(
                lambda: PrefillRuns.build(prefill_rows, computed, new, query_start, tables, block_size, sliding_window)
            )
        return cls(
            slot_mapping=to_dev(slots),
            block_tables=to_dev(tables),
            query_start_loc=to_dev(query_start),
            seq_lens=to_dev(seq_lens),
            positions=to_dev(positions),
            last_token_indices=to_dev(query_start[1:] - 1),
            num_tokens=num_tokens,
            block_size=block_size,
            max_seq_len=int(seq_lens.max()),
            decodes_only=num_tokens == num_reqs,
            _plan_groups=lambda: segments().groups(np.arange(len(segments().req))),
            sliding_window=sliding_window,
            prefill_requests=prefill_requests,
            beside_prefill=beside_prefill,
            plan_prefill_runs=plan_prefill_runs,
        )

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        scale: float,
        sliding_window: int | None,
        workspace: GatherWorkspace | None,
    ) -> torch.Tensor:
        """One layer's attention of this step (:func:`paged_attention`)."""
        return paged_attention(query, key, value, *kv_cache, self, scale, sliding_window, workspace)

    def decode_inputs(self, share_prefixes: bool = False) -> DecodeInputs | None:
        """This step's :class:`DecodeInputs` when every request decodes one token over all of its keys from
        position 0; else None. ``share_prefixes``: look for the blocks all requests' tables start with
        (:meth:`SharedPrefix.find`), for a step that runs eagerly (a compiled step's graph takes none)."""
        if not self.decodes_only or self.sliding_window is not None:
            return None
        block_tables = self.block_tables
        if block_tables.shape[1] == 1:  # a second (masked) column: one graph of a compiled step for every width
            block_tables = F.pad(block_tables, (0, 1))
        native = native_decode_available(self.seq_lens.device)
        shared = SharedPrefix.find(block_tables, self.seq_lens, self.block_size) if share_prefixes and native else None
        return DecodeInputs(self.slot_mapping, block_tables, self.seq_lens, native, shared)


# A decode step attends the blocks all of its requests share once for all of them (SharedPrefix) where that saves
# at least this many key reads ((requests - 1) x shared tokens). The flash call costs about 40 us of its own; each
# key a request no longer reads saved about 33 ns (SmolLM2's shapes, bfloat16, 2 threads, AMX). Measured per layer:
# 64 requests sharing 400 of 516 tokens 0.55 against 1.15 ms, 64 sharing 128 1.14 against 1.36, 8 sharing 400
# even (0.14), 8 sharing 128 slower (0.093 against 0.062).
SHARED_PREFIX_MIN_READS = 8192


class SharedPrefix(NamedTuple):
    """The blocks every request of a decode step starts with (a system prompt, a few-shot preamble): attended once
    for all requests' queries as one flash-attention call (cascade attention), whose outputs and log-sum-exps the
    decode kernel merges with each request's own keys after them (``tables`` and ``seq_lens``: the rest)."""

    # [S / block_size] the shared blocks' ids, in order.
    block_ids: torch.Tensor
    # [B, width - S / block_size] each request's table after them, and [B] its keys there.
    tables: torch.Tensor
    seq_lens: torch.Tensor

    @classmethod
    def find(cls, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> SharedPrefix | None:
        """The longest run of blocks that opens every table, short of each request's last key (the one this step
        writes stays the request's own); None where it saves fewer than SHARED_PREFIX_MIN_READS key reads, or off
        the CPU."""
        if len(seq_lens) < 2 or block_tables.device.type != "cpu":
            return None
        tables = block_tables.numpy()
        same = (tables == tables[:1]).all(axis=0)
        blocks = len(same) if same.all() else int(same.argmin())
        blocks = min(blocks, (int(seq_lens.min()) - 1) // block_size)
        if (len(seq_lens) - 1) * blocks * block_size < SHARED_PREFIX_MIN_READS:
            return None
        return cls(block_tables[0, :blocks], block_tables[:, blocks:].contiguous(), seq_lens - blocks * block_size)


class DecodeInputs(NamedTuple):
    """What a step of decodes only needs to know, as tensors: a compiled step's inputs (:class:`DecodeAttention`
    is built from them inside its graph, so that its masks' width is the tables' width times the block size, not a
    size of its own)."""

    # [B] cache slot of each request's new token.
    slot_mapping: torch.Tensor
    # [B, num_blocks] block table of each request, padded with 0 (to 2 blocks at least).
    block_tables: torch.Tensor
    # [B] tokens of each request after this step.
    seq_lens: torch.Tensor
    # Whether the layers run the native decode kernel (:func:`native_decode_available`), decided before the step
    # (a compiled step's graph is traced with the kernel's op or without it, and guarded on this).
    native: bool
    # The blocks all requests start with, for the native kernel of an eager step (:meth:`SharedPrefix.find`).
    shared_prefix: SharedPrefix | None = None


@dataclass(slots=True)
class DecodeAttention:
    """A step of decodes only (one new token a request, keys from position 0): its attention is one K/V write
    and, with the native kernel, one ``paged_decode_attention`` call reading each request's blocks in place; else
    one SDPA call over each request's blocks gathered, padded to the longest table and masked per window.

    Tensors only (no per-step Python decisions in the layers), so a compiled step's graph depends on nothing but
    the batch size and the table width.
    """

    # [B] cache slot of each request's new token.
    slot_mapping: torch.Tensor
    # [B, num_blocks] block table of each request, padded with 0.
    block_tables: torch.Tensor
    # [B] tokens of each request after this step.
    seq_lens: torch.Tensor
    # Per sliding window of the layers (None: none) the additive mask [B, 1, 1, num_blocks * block_size]; none
    # with the native kernel, which takes the window itself.
    masks: dict[int | None, torch.Tensor]
    native: bool
    shared_prefix: SharedPrefix | None = None

    @classmethod
    def build(
        cls, inputs: DecodeInputs, block_size: int, windows: Iterable[int | None], dtype: torch.dtype
    ) -> DecodeAttention:
        """The attention of a decode step for layers of ``windows`` (masks in ``dtype``, built once a step)."""
        if inputs.native and dtype in _NATIVE_DTYPES:
            return cls(inputs.slot_mapping, inputs.block_tables, inputs.seq_lens, {}, True, inputs.shared_prefix)
        kv_len = inputs.block_tables.shape[1] * block_size
        k_pos = torch.arange(kv_len, device=inputs.seq_lens.device)
        seq_lens = inputs.seq_lens[:, None]
        masks = {}
        for window in windows:
            allowed = k_pos < seq_lens
            if window is not None:
                allowed &= k_pos >= seq_lens - window
            masks[window] = torch.where(allowed, 0.0, float("-inf")).to(dtype)[:, None, None]
        return cls(inputs.slot_mapping, inputs.block_tables, inputs.seq_lens, masks, native=False)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        scale: float,
        sliding_window: int | None,
        workspace: GatherWorkspace | None,
    ) -> torch.Tensor:
        """Attend over the requests' blocks, where the new K/V are written already (:func:`write_kv_cache`);
        returns ``[B, num_heads * head_dim]``."""
        k_cache, v_cache = kv_cache
        if self.native and self.shared_prefix is not None and _flash_on_amx(query, k_cache):
            return _cascade_decode(query, k_cache, v_cache, self.shared_prefix, scale)
        if self.native:
            return torch.ops.prefixcache.paged_decode_attention(
                query, k_cache, v_cache, self.block_tables, self.seq_lens, scale, sliding_window
            )
        keys, values = _gather_kv(k_cache, v_cache, self.block_tables, workspace, query.dtype)
        return _decode_sdpa(query, keys, values, self.masks[sliding_window], scale)


class _Segments:
    """A step's requests split into segments (:func:`_segments`), with what grouping them needs: the plain arrays
    of :meth:`AttentionMetadata.build`, kept so that its groups can be built when first used."""

    def __init__(
        self,
        computed: np.ndarray,
        new: np.ndarray,
        query_start: np.ndarray,
        tables: np.ndarray,
        block_size: int,
        sliding_window: int | None,
        to_dev: Callable[[np.ndarray], torch.Tensor],
    ) -> None:
        self.req, self.computed, self.new = _segments(computed, new, split_fresh=sliding_window is not None)
        self.start = query_start[self.req] + self.computed - computed[self.req]
        if sliding_window is None:
            self.kv_start = np.zeros_like(self.computed)
        else:
            self.kv_start = np.maximum(self.computed - sliding_window + 1, 0) // block_size * block_size
        self.tables = tables
        self.block_size = block_size
        self.to_dev = to_dev

    def groups(self, segments: np.ndarray) -> tuple[AttentionGroup, ...]:
        """The listed segments in groups (:func:`_partition`), each with its indices (:func:`_build_group`)."""
        parts = _partition(self.computed[segments], self.new[segments], self.kv_start[segments])
        return tuple(
            _build_group(
                segments[part],
                self.req,
                self.computed,
                self.new,
                self.kv_start,
                self.start,
                self.tables,
                self.block_size,
                self.to_dev,
            )
            for part in parts
        )


def _segments(computed: np.ndarray, new: np.ndarray, split_fresh: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split the new tokens of requests with earlier context into query chunks of at most _QUERY_CHUNK.

    A masked SDPA call computes the whole [queries x keys] rectangle. A chunk only reaches keys up to its own
    last position, so chunks skip most of the causal upper triangle (about 20% less attention work for 2k
    new tokens after a 2k prefix). A fresh prompt is not split: its unmasked causal call skips it already,
    unless ``split_fresh`` (a sliding window: each chunk then reads only the keys of its window).
    Returns, per segment: request index, tokens before the segment, tokens in the segment.
    """
    pieces = np.where((computed > 0) | split_fresh, -(-new // _QUERY_CHUNK), 1)
    seg_req = np.repeat(np.arange(len(new)), pieces)
    offset = (np.arange(len(seg_req)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * _QUERY_CHUNK
    seg_new = np.where(pieces[seg_req] == 1, new[seg_req], np.minimum(new[seg_req] - offset, _QUERY_CHUNK))
    return seg_req, computed[seg_req] + offset, seg_new


def _partition(computed: np.ndarray, new: np.ndarray, kv_start: np.ndarray) -> list[np.ndarray]:
    """Split segments (see :func:`_segments`) into groups whose padded attention wastes little work.

    Greedy over segments sorted by (new tokens, keys read) descending: a segment joins the current group when
    the padded cost grows by no more than running it alone plus a fixed per-call cost. So decodes of similar
    length share one call, while a long prefill chunk never gets padded to by short ones (and vice versa),
    which keeps the padded K/V gather and mask close to the useful size.
    """
    spans = computed + new - kv_start

    def alone(r: int) -> int:
        q, k = int(new[r]), int(spans[r])
        return q * k // 2 if computed[r] == 0 else q * k

    groups: list[list[int]] = []
    members: list[int] = []
    max_q = max_k = cost = 0
    for r in np.lexsort((-spans, -new)).tolist():
        q, k = int(new[r]), int(spans[r])
        if members:
            merged_q, merged_k = max(max_q, q), max(max_k, k)
            merged = (len(members) + 1) * merged_q * merged_k
            if merged <= cost + alone(r) + _GROUP_CALL_COST:
                members.append(r)
                max_q, max_k, cost = merged_q, merged_k, merged
                continue
            groups.append(members)
        members, max_q, max_k, cost = [r], q, k, alone(r)
    groups.append(members)
    return [np.sort(np.asarray(g, dtype=np.int64)) for g in groups]


def _build_group(
    seg: np.ndarray,
    seg_req: np.ndarray,
    seg_computed: np.ndarray,
    seg_new: np.ndarray,
    seg_kv_start: np.ndarray,
    seg_start: np.ndarray,
    tables: np.ndarray,
    block_size: int,
    to_dev: Callable[[np.ndarray], torch.Tensor],
) -> AttentionGroup:
    """Precompute the gather/pad indices of one group of segments (see :class:`AttentionGroup`)."""
    num_reqs = len(seg)
    q_lens = seg_new[seg]
    computed = seg_computed[seg]
    seq_lens = computed + q_lens
    kv_start = seg_kv_start[seg]
    first_block = kv_start // block_size
    max_q = int(q_lens.max())
    fresh = num_reqs == 1 and computed[0] == 0
    num_blocks = int((-(-seq_lens // block_size) - first_block).max())
    kv_len = max_q if fresh else num_blocks * block_size
    rows = seg_req[seg]
    if first_block.any():
        # Columns past a table's end are padding (hidden by the causal mask); clip them into the table.
        cols = np.minimum(first_block[:, None] + np.arange(num_blocks), tables.shape[1] - 1)
        block_tables = tables[rows[:, None], cols]
    else:
        block_tables = tables[rows, :num_blocks]
    q_pos = np.minimum(computed[:, None] + np.arange(max_q)[None, :], seq_lens[:, None] - 1)

    padded = bool((q_lens != max_q).any())
    contiguous = bool((np.diff(seg) == 1).all())
    token_slice = token_index = pad_index = None
    if contiguous and not padded:
        token_slice = (int(seg_start[seg[0]]), int(seg_start[seg[-1]] + q_lens[-1]))
    else:
        within = np.arange(int(q_lens.sum())) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
        token_index = to_dev(np.repeat(seg_start[seg], q_lens) + within)
        if padded:
            pad_index = to_dev(np.repeat(np.arange(num_reqs) * max_q, q_lens) + within)
    return AttentionGroup(
        num_reqs=num_reqs,
        max_q=max_q,
        kv_len=kv_len,
        block_tables=to_dev(block_tables),
        q_pos=to_dev(q_pos),
        token_slice=token_slice,
        token_index=token_index,
        pad_index=pad_index,
        fresh=fresh,
        kv_start=to_dev(kv_start) if first_block.any() else None,
        kv_lens=to_dev(seq_lens - kv_start),
        max_reach=int((seq_lens - 1 - kv_start).max()),
    )


class GatherWorkspace:
    """Reusable buffers for the gathered K/V of a layer.

    On CPU a fresh multi-MB tensor per layer costs page faults that can exceed the gather itself, so the
    buffers are kept and grown on demand. On other devices the caching allocator already reuses memory and
    this returns None (plain allocation).
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]

    def get(self, which: int, like: torch.Tensor, numel: int) -> torch.Tensor | None:
        if like.device.type != "cpu":
            return None
        buf = self._buffers[which]
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffers[which] = buf
        return buf[:numel]


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the new tokens' K/V ``[T, kv_heads, head_dim]`` at their slots."""
    _, _, kv_heads, head_dim = k_cache.shape
    if key.dtype != k_cache.dtype:
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def _gather(
    cache: torch.Tensor, block_tables: torch.Tensor, workspace: GatherWorkspace | None, which: int
) -> torch.Tensor:
    """Gather the listed blocks: ``[G, num_blocks * block_size, kv_heads, head_dim]``."""
    num_reqs, num_blocks = block_tables.shape
    _, block_size, kv_heads, head_dim = cache.shape
    flat = block_tables.reshape(-1)
    buf = None if workspace is None else workspace.get(which, cache, flat.numel() * cache[0].numel())
    if buf is None:
        out = cache.index_select(0, flat)
    else:
        out = torch.index_select(cache, 0, flat, out=buf.view(-1, block_size, kv_heads, head_dim))
    return out.view(num_reqs, num_blocks * block_size, kv_heads, head_dim)


def _gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    workspace: GatherWorkspace | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the listed blocks ``[G, kv_heads, num_blocks * block_size, head_dim]`` in ``dtype``."""
    keys = _gather(k_cache, block_tables, workspace, 0).transpose(1, 2)
    values = _gather(v_cache, block_tables, workspace, 1).transpose(1, 2)
    if keys.dtype != dtype:
        keys, values = keys.to(dtype), values.to(dtype)
    return keys, values


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    workspace: GatherWorkspace | None = None,
) -> torch.Tensor:
    """Attend over the cache, where the step's K/V are written already (:func:`write_kv_cache`); returns
    ``[T, num_heads * head_dim]``.

    ``query`` is ``[T, num_heads, head_dim]``; ``key``/``value`` are ``[T, num_kv_heads, head_dim]`` (read for a
    fresh request's group, which needs no gather).
    """
    num_tokens, num_heads, head_dim = query.shape
    groups = metadata.groups
    if metadata.beside_prefill is not None and {query.dtype, k_cache.dtype} <= _PREFILL_KERNEL_DTYPES:
        # The kernel fills the rows of the prefill requests; the groups below fill the others.
        out = _paged_prefill(query, k_cache, v_cache, metadata, scale, sliding_window, workspace)
        groups = metadata.beside_prefill
    elif len(groups) == 1 and groups[0].token_slice == (0, num_tokens):
        return _group_attention(groups[0], query, key, value, k_cache, v_cache, scale, sliding_window, workspace)
    else:
        out = query.new_empty(num_tokens, num_heads * head_dim)
    for group in groups:
        if group.token_slice is not None:
            start, end = group.token_slice
            out[start:end] = _group_attention(
                group,
                query[start:end],
                key[start:end],
                value[start:end],
                k_cache,
                v_cache,
                scale,
                sliding_window,
                workspace,
            )
        else:
            assert group.token_index is not None
            rows = group.token_index
            result = _group_attention(
                group,
                query.index_select(0, rows),
                key.index_select(0, rows),
                value.index_select(0, rows),
                k_cache,
                v_cache,
                scale,
                sliding_window,
                workspace,
            )
            out.index_copy_(0, rows, result)
    return out


# The query and cache dtypes paged_prefill_attention takes (it computes in float32); others take torch's path.
_PREFILL_KERNEL_DTYPES = {torch.float32, torch.bfloat16, torch.float16}


@cache
def _prefill_kernel() -> Callable[..., torch.Tensor] | None:
    """prefixcache's ``paged_prefill_attention`` (CPU tensors only), or None where its kernels are unavailable.
    Its fake implementation is registered with it, so that a compiled graph can hold it as an opaque op."""
    ops = native_ops()
    if ops is None:
        return None

    @torch.library.register_fake("prefixcache::paged_prefill_attention")
    def _(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, requests, scale, window):
        return query.new_empty(query.shape[0], query.shape[1] * query.shape[2])

    return ops.paged_prefill_attention


def _flash_on_amx(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether a CPU layer attends through torch's flash attention where it can: a prefill, one call a request
    (instead of prefixcache's prefill kernel), and a decode step's shared prefix (:class:`SharedPrefix`).

    In bfloat16 on a CPU with AMX tiles it does: torch's flash attention runs its Q·K and P·V products through
    oneDNN's brgemm on the tiles, while the kernels widen to float32 and use vector FMAs. On SmolLM2's
    saturation step (2,048 queries over 400 shared + 100 new tokens each) one prefill layer took 6.4 against
    14.8 ms on 2 threads, 11.1 against 28.6 on one. In float32 the kernels are as fast (13.7 against 14.8 ms)
    and keep what torch's does not promise: a query's output bit for bit the same however its prompt was split
    into cached and new tokens, and however its request was batched. bfloat16 outputs already differ in the
    last bit between such splits (their products are rounded per call), so they lose nothing by it. A compiled
    graph keeps the kernels (one op each).
    """
    return query.dtype == k_cache.dtype == torch.bfloat16 and amx_tiles() and not torch.compiler.is_compiling()


class PrefillRuns(NamedTuple):
    """A step's prefill requests as torch's flash attention takes them (:func:`_sdpa_prefill`): every layer
    gathers ``block_ids`` (each request's blocks, from the one holding its first visible key) in one call, and
    attends each run ``(first query row, query rows, first gathered key row, keys, mask)`` in one SDPA call.
    ``mask`` is additive ``[queries, keys]`` in the layers' dtype (see :meth:`AttentionGroup.mask`); None where
    the keys are exactly the queries' own and nothing is left of a window: the plain causal case."""

    block_ids: torch.Tensor
    runs: tuple[tuple[int, int, int, int, torch.Tensor | None], ...]

    @classmethod
    def build(
        cls,
        requests: np.ndarray,
        computed: np.ndarray,
        new: np.ndarray,
        query_start: np.ndarray,
        tables: np.ndarray,
        block_size: int,
        window: int | None,
    ) -> PrefillRuns:
        ids, runs, key_row = [], [], 0
        for r in requests.tolist():
            done, count = int(computed[r]), int(new[r])
            first_block = 0 if window is None else max(done - window + 1, 0) // block_size
            last_block = -(-(done + count) // block_size)
            ids.append(tables[r, first_block:last_block])
            first_key = first_block * block_size
            keys = done + count - first_key
            mask = None
            if done > 0 or (window is not None and count > window):
                q_pos = torch.arange(done, done + count)[:, None]
                k_pos = torch.arange(first_key, first_key + keys)[None, :]
                hidden = k_pos > q_pos
                if window is not None:
                    hidden |= k_pos <= q_pos - window
                mask = torch.zeros(hidden.shape, dtype=torch.bfloat16).masked_fill_(hidden, float("-inf"))
            runs.append((int(query_start[r]), count, key_row, keys, mask))
            key_row += (last_block - first_block) * block_size
        return cls(torch.from_numpy(np.concatenate(ids)), tuple(runs))


def _sdpa_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefill: PrefillRuns,
    scale: float,
    workspace: GatherWorkspace | None,
) -> torch.Tensor:
    """:func:`_paged_prefill`'s result through torch's flash attention (see :func:`_flash_on_amx`)."""
    num_tokens, num_heads, head_dim = query.shape
    block_ids = prefill.block_ids[None]
    keys = _gather(k_cache, block_ids, workspace, 0)[0]
    values = _gather(v_cache, block_ids, workspace, 1)[0]
    out = query.new_empty(num_tokens, num_heads * head_dim)
    gqa = k_cache.shape[2] != num_heads
    for q_row, q_len, k_row, k_len, mask in prefill.runs:
        attended = F.scaled_dot_product_attention(
            query[q_row : q_row + q_len].transpose(0, 1)[None],
            keys[k_row : k_row + k_len].transpose(0, 1)[None],
            values[k_row : k_row + k_len].transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        out[q_row : q_row + q_len].view(q_len, num_heads, head_dim).copy_(attended[0].transpose(0, 1))
    return out


def _cascade_decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, shared: SharedPrefix, scale: float
) -> torch.Tensor:
    """A decode step's attention ``[B, heads * head_dim]`` as two parts merged: every request's query over the
    shared blocks in one flash-attention call (the requests' query heads of a KV head are that call's query rows:
    one product over the shared keys for all of them), then the decode kernel over each request's own keys, which
    merges the first part's outputs by their log-sum-exps."""
    batch, heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    keys = k_cache.index_select(0, shared.block_ids).view(1, -1, kv_heads, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, shared.block_ids).view(1, -1, kv_heads, head_dim).transpose(1, 2)
    rows = query.reshape(batch, kv_heads, group, head_dim).transpose(0, 1).reshape(1, kv_heads, batch * group, -1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(rows, keys, values, scale=scale)[:2]
    prefix_out = out[0].reshape(kv_heads, batch, group, head_dim).transpose(0, 1).reshape(batch, heads, head_dim)
    prefix_lse = lse[0].reshape(kv_heads, batch, group).transpose(0, 1).reshape(batch, heads)
    return torch.ops.prefixcache.paged_decode_attention(
        query, k_cache, v_cache, shared.tables, shared.seq_lens, scale, None, prefix_out, prefix_lse
    )


def _paged_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    workspace: GatherWorkspace | None,
) -> torch.Tensor:
    """``[T, num_heads * head_dim]`` whose rows of ``metadata.prefill_requests`` hold their attention (each query
    over its request's keys up to its own position, within ``sliding_window``), read from the cache; the other
    rows are unset."""
    if metadata.plan_prefill_runs is not None and _flash_on_amx(query, k_cache):
        return _sdpa_prefill(query, k_cache, v_cache, metadata.plan_prefill_runs(), scale, workspace)
    kernel = _prefill_kernel()
    assert kernel is not None, "prefill_requests are set only where the kernel runs"
    if query.stride(-1) != 1:
        query = query.contiguous()
    return kernel(
        query,
        k_cache,
        v_cache,
        metadata.block_tables,
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.prefill_requests,
        scale,
        sliding_window,
    )


def _group_attention(
    group: AttentionGroup,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    workspace: GatherWorkspace | None,
) -> torch.Tensor:
    """Attention of one group; inputs and output are the group's tokens in group order."""
    if (
        group.max_q == 1
        and query.dtype in _NATIVE_DTYPES
        and k_cache.dtype in _NATIVE_DTYPES
        and native_decode_available(query.device)
    ):
        return torch.ops.prefixcache.paged_decode_attention(
            query, k_cache, v_cache, group.block_tables, group.kv_lens, scale, sliding_window
        )
    _, num_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    mask = group.mask(sliding_window, query.dtype)
    if group.fresh and key.dtype == k_cache.dtype:
        # The keys are exactly this step's tokens: skip the gather.
        keys, values = key[None].transpose(1, 2), value[None].transpose(1, 2)
    else:
        keys, values = _gather_kv(k_cache, v_cache, group.block_tables, workspace, query.dtype)

    if group.max_q == 1:
        return _decode_sdpa(query, keys, values, mask, scale)

    if group.pad_index is not None:
        padded = query.new_zeros(group.num_reqs * group.max_q, num_heads, head_dim)
        query = padded.index_copy_(0, group.pad_index, query)
    q = query.view(group.num_reqs, group.max_q, num_heads, head_dim).transpose(1, 2)
    if kv_heads != num_heads and not _sdpa_gqa_supported(query.device, mask):
        keys = keys.repeat_interleave(num_heads // kv_heads, dim=1)
        values = values.repeat_interleave(num_heads // kv_heads, dim=1)
    out = F.scaled_dot_product_attention(
        q,
        keys,
        values,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=keys.shape[1] != num_heads,
    )
    out = out.transpose(1, 2).reshape(group.num_reqs * group.max_q, num_heads * head_dim)
    if group.pad_index is not None:
        out = out.index_select(0, group.pad_index)
    return out


def _decode_sdpa(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One query a request ``[B, num_heads, head_dim]`` over ``keys``/``values`` ``[B, kv_heads, S, head_dim]``.

    The query heads that share a KV head are folded into the query-length axis, so GQA needs no K/V expansion
    and the ``[B, 1, 1, S]`` mask broadcasts over heads.
    """
    num_reqs, num_heads, head_dim = query.shape
    kv_heads = keys.shape[1]
    q = query.view(num_reqs, kv_heads, num_heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(num_reqs, num_heads * head_dim)


def _sdpa_gqa_supported(device: torch.device, mask: torch.Tensor | None) -> bool:
    """Whether SDPA's ``enable_gqa`` runs a fused kernel for these inputs.

    On CUDA only the flash kernel supports GQA and it takes no mask, so masked calls would fall back to the
    slow math kernel; expanding K/V instead keeps the memory-efficient kernel. The CPU kernel handles both.
    """
    return device.type == "cpu" or mask is None


def native_decode_available(device: torch.device) -> bool:
    """Whether decodes on ``device`` run prefixcache's ``paged_decode_attention`` kernel (CPU, kernels built);
    else torch's gather and SDPA. Registers the op's fake implementation first (what a compiled step traces)."""
    if device.type != "cpu" or native_ops() is None:
        return False
    _register_paged_decode_fake()
    return True


@cache
def _register_paged_decode_fake() -> None:
    """The output's shape and dtype (``[B, heads * head_dim]`` in the query's), for tracing the op as opaque."""

    @torch.library.register_fake("prefixcache::paged_decode_attention")
    def _(
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int | None,
        prefix_out: torch.Tensor | None = None,
        prefix_lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return query.new_empty(query.shape[0], query.shape[1] * query.shape[2])
