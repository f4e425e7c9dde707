"""``prefixcache::paged_decode_attention`` (native/paged_decode.cpp) against torch's decode path: the same
attention, read in place through the block tables instead of gathered, padded and masked."""

from __future__ import annotations

import math

import pytest
import torch

from prefixcache.model.attention import DecodeAttention, DecodeInputs, GatherWorkspace, write_kv_cache
from prefixcache.model.native import native_ops

if native_ops() is None:
    pytest.skip("prefixcache's CPU kernels are not built here (no compiler, or switched off)", allow_module_level=True)

# float32: the same math in another order (tiles of keys, a polynomial exp); bfloat16 and float16: the output's
# rounding to the query's dtype (2^-8 and 2^-11 relative) on top of that.
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 8e-3, "rtol": 1.6e-2},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
}
NULL_BLOCK = 0  # what tables are padded with, and what stands left of a window


def decode_case(
    seq_lens: list[int], block_size: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[DecodeInputs, torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """A decode step over random K/V: every request's blocks distinct and shuffled, its table padded with the
    null block to the longest. Returns (inputs for torch's path, query, new key, new value, the caches)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 1
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # never the null block
    width = max(max(blocks), 2)
    tables = torch.full((len(seq_lens), width), NULL_BLOCK, dtype=torch.long)
    for r, n in enumerate(blocks):
        tables[r, :n] = torch.tensor([order.pop() for _ in range(n)])
    lens = torch.tensor(seq_lens)
    last = lens - 1
    slots = tables[torch.arange(len(seq_lens)), last // block_size] * block_size + last % block_size
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
    for cache in caches:
        cache[NULL_BLOCK] = 0  # torch's path multiplies the masked keys it gathers: they must be finite
    query = torch.randn(len(seq_lens), heads, head_dim, generator=gen).to(dtype)
    key, value = (torch.randn(len(seq_lens), kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    return DecodeInputs(slots, tables, lens, native=False), query, key, value, caches


def attend(
    inputs: DecodeInputs,
    native: bool,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    window: int | None,
    poison: list[int] = (),
) -> torch.Tensor:
    """``DecodeAttention.attend`` on copies of the caches, by the kernel or by torch's path. The kernel's caches
    hold NaN in the null block and in the blocks listed in ``poison``: reading any of them would show."""
    caches = tuple(c.clone() for c in caches)
    if native:
        for cache in caches:
            cache[[NULL_BLOCK, *poison]] = float("nan")
    attention = DecodeAttention.build(inputs._replace(native=native), caches[0].shape[1], [window], query.dtype)
    write_kv_cache(key, value, *caches, attention.slot_mapping)
    scale = 1 / math.sqrt(query.shape[-1])
    return attention.attend(query, key, value, caches, scale, window, GatherWorkspace())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(8, 2, 64), (4, 4, 24), (6, 1, 80), (16, 1, 32)],  # GQA, MHA with a partial vector, MQA, more than 8 a group
)
@pytest.mark.parametrize("window", [None, 7, 300])
def test_kernel_matches_the_torch_path(
    dtype: torch.dtype, block_size: int, heads: int, kv_heads: int, head_dim: int, window: int | None
) -> None:
    """Sequences of one key, of whole blocks, one past them, and long enough to be split (256 keys a split)."""
    seq_lens = [1, 16, 32, 17, 600, 3]
    inputs, query, key, value, caches = decode_case(seq_lens, block_size, heads, kv_heads, head_dim, dtype)
    # Blocks wholly left of a request's window are never read: poisoned for the kernel.
    poison = []
    if window is not None:
        for r, n in enumerate(seq_lens):
            poison += inputs.block_tables[r, : max(n - window, 0) // block_size].tolist()
    ours = attend(inputs, True, query, key, value, caches, window, poison)
    theirs = attend(inputs, False, query, key, value, caches, window)
    assert ours.dtype == dtype and ours.shape == (len(seq_lens), heads * head_dim)
    assert ours.isfinite().all()
    torch.testing.assert_close(ours, theirs, **TOLERANCES[dtype])


def test_a_request_attends_the_same_alone_or_batched() -> None:
    """Each request's result depends on its own keys only, bit for bit (its splits are cut by its length, not by
    the batch or the threads), so a step's batching never changes what a request decodes."""
    seq_lens = [700, 5, 300, 48]
    inputs, query, key, value, caches = decode_case(seq_lens, 16, 6, 2, 64, torch.float32)
    batched = attend(inputs, True, query, key, value, caches, None)
    for r in range(len(seq_lens)):
        one = inputs._replace(
            slot_mapping=inputs.slot_mapping[r : r + 1],
            block_tables=inputs.block_tables[r : r + 1],
            seq_lens=inputs.seq_lens[r : r + 1],
        )
        alone = attend(one, True, query[r : r + 1], key[r : r + 1], value[r : r + 1], caches, None)
        assert torch.equal(alone[0], batched[r])


def test_query_heads_may_be_strided() -> None:
    """The query is a view of the fused projection (heads of Q and K side by side): no copy needed."""
    inputs, query, key, value, caches = decode_case([20, 33], 16, 4, 2, 32, torch.float32)
    side_by_side = torch.cat([query, key], dim=1)[:, :4]
    assert not side_by_side.is_contiguous()
    torch.testing.assert_close(
        attend(inputs, True, side_by_side, key, value, caches, None),
        attend(inputs, True, query, key, value, caches, None),
        atol=0,
        rtol=0,
    )


@pytest.mark.parametrize(
    ("seq_lens", "table_entry", "match"),
    [
        ([33], None, "has 33 keys; its table holds 1 to 32"),
        ([0], None, "has 0 keys"),
        ([5], 99, "reads block 99 of a cache of"),
    ],
)
def test_bad_tables_are_refused(seq_lens: list[int], table_entry: int | None, match: str) -> None:
    _, query, _, _, (k_cache, v_cache) = decode_case([5], 16, 4, 2, 32, torch.float32)
    tables = torch.tensor([[1, 0]]) if table_entry is None else torch.tensor([[table_entry, 0]])
    with pytest.raises(RuntimeError, match=match):
        torch.ops.prefixcache.paged_decode_attention(query, k_cache, v_cache, tables, torch.tensor(seq_lens), 1.0, None)


def test_a_float64_model_keeps_the_torch_path() -> None:
    """The kernel sums in float32: a float64 decode step runs torch's gather and SDPA even where it is built."""
    inputs, query, key, value, caches = decode_case([20, 7], 16, 4, 2, 32, torch.float64)
    attention = DecodeAttention.build(inputs._replace(native=True), 16, [None], torch.float64)
    assert not attention.native
    write_kv_cache(key, value, *caches, inputs.slot_mapping)
    ours = attention.attend(query, key, value, caches, 1 / math.sqrt(32), None, GatherWorkspace())
    torch.testing.assert_close(ours, attend(inputs, False, query, key, value, caches, None), atol=0, rtol=0)
