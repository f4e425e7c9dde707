"""``prefixcache::paged_decode_attention`` (native/paged_decode.cpp) against torch's decode path: the same
attention, read in place through the block tables instead of gathered, padded and masked."""

from __future__ import annotations

import math

import pytest
import torch

from prefixcache.model import attention as attention_mod
from prefixcache.model.attention import (
    SHARED_PREFIX_MIN_READS,
    DecodeAttention,
    DecodeInputs,
    GatherWorkspace,
    SharedPrefix,
    write_kv_cache,
)
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


def reference_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in float64 of ``query`` [B, heads, D] over ``keys``/``values`` [B, S, kv_heads, D]:
    the output [B, heads, D] and the log-sum-exp [B, heads] of the scaled scores."""
    heads, kv_heads = query.shape[1], keys.shape[2]
    k = keys.double().repeat_interleave(heads // kv_heads, dim=2)
    v = values.double().repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bhd,bshd->bhs", query.double(), k) / math.sqrt(query.shape[-1])
    return torch.einsum("bhs,bshd->bhd", scores.softmax(-1), v), scores.logsumexp(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefix_merges_as_if_its_keys_came_before_the_table_s(dtype: torch.dtype) -> None:
    """The kernel over each request's table after a prefix, given the prefix's output and log-sum-exp, equals
    attention over prefix and table together; the prefix's blocks are poisoned: only the table is read."""
    seq_lens, prefix_blocks, block_size = [70, 33, 300], 2, 16
    inputs, query, _, _, (k_cache, v_cache) = decode_case(seq_lens, block_size, 6, 2, 64, dtype)
    tables = inputs.block_tables
    whole = torch.ops.prefixcache.paged_decode_attention(
        query, k_cache, v_cache, tables, inputs.seq_lens, 1 / math.sqrt(64), None
    )
    prefix_keys = k_cache[tables[:, :prefix_blocks]].flatten(1, 2)
    prefix_values = v_cache[tables[:, :prefix_blocks]].flatten(1, 2)
    prefix_out, prefix_lse = reference_attention(query, prefix_keys, prefix_values)
    poisoned = [cache.clone() for cache in (k_cache, v_cache)]
    for cache in poisoned:
        cache[tables[:, :prefix_blocks].flatten()] = float("nan")
    merged = torch.ops.prefixcache.paged_decode_attention(
        query,
        *poisoned,
        tables[:, prefix_blocks:].contiguous(),
        inputs.seq_lens - prefix_blocks * block_size,
        1 / math.sqrt(64),
        None,
        prefix_out.to(dtype),
        prefix_lse.float(),
    )
    torch.testing.assert_close(merged, whole, **TOLERANCES[dtype])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: a.pop("prefix_lse"), "go together"),
        (lambda a: a.update(prefix_lse=a["prefix_lse"].double()), "prefix_lse must be float32"),
        (lambda a: a.update(prefix_out=a["prefix_out"][:, :2]), "prefix_out must be"),
        (lambda a: a.update(window=8), "a prefix and a window"),
    ],
)
def test_a_bad_prefix_is_refused(change, match: str) -> None:
    inputs, query, _, _, (k_cache, v_cache) = decode_case([20, 7], 16, 4, 2, 32, torch.float32)
    args = dict(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=inputs.block_tables)
    args |= dict(seq_lens=inputs.seq_lens, scale=1.0, window=None, prefix_out=query.clone())
    args["prefix_lse"] = torch.zeros(2, 4)
    change(args)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.prefixcache.paged_decode_attention(**args)


def shared_tables(requests: int, shared: int, own: int) -> torch.Tensor:
    """Block tables whose first ``shared`` blocks are the same (ids 1..shared) and whose next ``own`` are each
    request's own."""
    tables = torch.zeros(requests, shared + own, dtype=torch.long)
    tables[:, :shared] = torch.arange(1, shared + 1)
    tables[:, shared:] = shared + 1 + torch.arange(requests * own).view(requests, own)
    return tables


def test_the_shared_prefix_is_the_blocks_every_table_opens_with() -> None:
    tables = shared_tables(64, 25, 8)
    tables[5, 24] = 999  # one request parts after 24 blocks
    lens = torch.full((64,), 500)
    found = SharedPrefix.find(tables, lens, 16)
    assert found is not None and found.block_ids.tolist() == list(range(1, 25))
    assert torch.equal(found.tables, tables[:, 24:]) and found.seq_lens.tolist() == [500 - 24 * 16] * 64
    # each request keeps its last key (the one this step writes): a request of 385 keys holds 24 full blocks + 1
    assert SharedPrefix.find(tables, lens.clone().fill_(24 * 16), 16).block_ids.numel() == 23


def test_a_shared_prefix_too_small_to_pay_is_not_taken() -> None:
    blocks = SHARED_PREFIX_MIN_READS // 16  # tokens of a request: (2 - 1) x shared blocks x 16 = the minimum
    assert SharedPrefix.find(shared_tables(2, blocks, 1), torch.full((2,), blocks * 16 + 1), 16) is not None
    assert SharedPrefix.find(shared_tables(2, blocks - 1, 2), torch.full((2,), blocks * 16 + 1), 16) is None
    assert SharedPrefix.find(shared_tables(1, blocks * 4, 1), torch.tensor([blocks * 64 + 1]), 16) is None


@pytest.mark.parametrize(("dtype", "amx", "cascade"), [(torch.bfloat16, True, True), (torch.bfloat16, False, False)])
def test_a_decode_step_attends_the_shared_prefix_once_in_bfloat16_on_amx(
    dtype: torch.dtype, amx: bool, cascade: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests sharing their first blocks: with AMX tiles the step attends them in one flash call for all
    requests and merges; the result agrees with the plain kernel's to bfloat16's rounding."""
    monkeypatch.setattr(attention_mod, "amx_tiles", lambda: amx)
    calls = []
    cascade_decode = attention_mod._cascade_decode
    monkeypatch.setattr(attention_mod, "_cascade_decode", lambda *a: calls.append(1) or cascade_decode(*a))
    requests, shared, own, block_size, heads, kv_heads, dim = 24, 24, 3, 16, 9, 3, 64
    tables = shared_tables(requests, shared, own)
    lens = torch.tensor([shared * block_size + 1 + 2 * r for r in range(requests)])
    gen = torch.Generator().manual_seed(0)
    shape = (1 + shared + requests * own, block_size, kv_heads, dim)
    caches = tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    query = torch.randn(requests, heads, dim, generator=gen).to(dtype)
    slots = torch.zeros(requests, dtype=torch.long)
    shared_prefix = SharedPrefix.find(tables, lens, block_size)
    assert shared_prefix is not None
    plain = DecodeAttention.build(DecodeInputs(slots, tables, lens, True), block_size, [None], dtype)
    with_prefix = DecodeAttention.build(
        DecodeInputs(slots, tables, lens, True, shared_prefix), block_size, [None], dtype
    )
    expected = plain.attend(query, None, None, caches, dim**-0.5, None, None)
    got = with_prefix.attend(query, None, None, caches, dim**-0.5, None, None)
    assert len(calls) == cascade
    torch.testing.assert_close(got, expected, **TOLERANCES[dtype])


def test_float32_never_takes_the_shared_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 keeps a request's decode bit for bit independent of its batch, so its shared prefix is read per
    request as before, even where a step found one."""
    monkeypatch.setattr(attention_mod, "amx_tiles", lambda: True)
    tables, lens = shared_tables(16, 40, 1), torch.full((16,), 40 * 16 + 1)
    inputs, query, key, value, caches = decode_case([641] * 16, 16, 4, 2, 32, torch.float32)
    inputs = inputs._replace(block_tables=tables, seq_lens=lens, slot_mapping=torch.zeros(16, dtype=torch.long))
    caches = tuple(torch.randn(tables.max() + 1, *c.shape[1:]) for c in caches)
    shared = inputs._replace(native=True, shared_prefix=SharedPrefix.find(tables, lens, 16))
    assert shared.shared_prefix is not None
    got = DecodeAttention.build(shared, 16, [None], torch.float32).attend(query, key, value, caches, 0.2, None, None)
    plain = DecodeAttention.build(inputs._replace(native=True), 16, [None], torch.float32)
    assert torch.equal(got, plain.attend(query, key, value, caches, 0.2, None, None))


def with_private_blocks(tables: torch.Tensor, seq_lens: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor]):
    """The same step as the prefix cache off would run it: every request's blocks copied to blocks of its own
    (the same K/V), so that no two tables share a block. Returns (tables, caches)."""
    block_size = caches[0].shape[1]
    copies, private = [], torch.zeros_like(tables)
    for r, n in enumerate(seq_lens.tolist()):
        for i in range(-(-n // block_size)):
            private[r, i] = caches[0].shape[0] + len(copies)
            copies.append(int(tables[r, i]))
    return private, tuple(torch.cat([cache, cache[copies]]) for cache in caches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (16, 1)])  # SmolLM2's GQA; a group of more than 8
@pytest.mark.parametrize("window", [None, 100])
def test_requests_sharing_blocks_decode_as_with_blocks_of_their_own(
    dtype: torch.dtype, heads: int, kv_heads: int, window: int | None
) -> None:
    """Requests that share a prefix in the cache have their splits over it attended together (each shared row
    read once for all their heads); every request's result is still the same bit for bit as with private copies
    of its blocks (the prefix cache off) and as alone. 20 requests share 20 blocks (more of them than one work
    item takes: two of three heads a KV head, one of sixteen), two of them also a 21st, beside two of the same
    length that share nothing."""
    block_size, dim, shared = 16, 64, 20
    gen = torch.Generator().manual_seed(3)
    lens = [shared * block_size + 1 + 7 * r for r in range(18)] + [340, 340, 90, 90]
    tables = torch.zeros(len(lens), 30, dtype=torch.long)
    tables[:20, :shared] = torch.arange(1, shared + 1)
    tables[18:20, shared] = shared + 1  # the twins: 21 blocks alike, then a block each
    next_block = shared + 2
    for r, n in enumerate(lens):
        for i in range(-(-n // block_size)):
            if tables[r, i] == 0:
                tables[r, i], next_block = next_block, next_block + 1
    seq_lens = torch.tensor(lens)
    shape = (next_block, block_size, kv_heads, dim)
    caches = tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    query = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    scale = dim**-0.5

    def kernel(tables: torch.Tensor, lens: torch.Tensor, caches, query: torch.Tensor) -> torch.Tensor:
        return torch.ops.prefixcache.paged_decode_attention(query, *caches, tables, lens, scale, window)

    shared_step = kernel(tables, seq_lens, caches, query)
    private_tables, private_caches = with_private_blocks(tables, seq_lens, caches)
    assert torch.equal(shared_step, kernel(private_tables, seq_lens, private_caches, query))
    for r in (0, 17, 18, 21):
        alone = kernel(tables[r : r + 1], seq_lens[r : r + 1], caches, query[r : r + 1])
        assert torch.equal(alone[0], shared_step[r])
    inputs = DecodeInputs(torch.zeros(len(lens), dtype=torch.long), tables, seq_lens, native=False)
    reference = DecodeAttention.build(inputs, block_size, [window], dtype)
    torch.testing.assert_close(
        shared_step, reference.attend(query, None, None, caches, scale, window, GatherWorkspace()), **TOLERANCES[dtype]
    )
