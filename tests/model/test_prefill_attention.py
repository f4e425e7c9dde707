"""prefixcache's native prefill kernel (``paged_prefill_attention``) against torch's grouped SDPA path, and the
property prefix caching relies on: a query's output is the same bit for bit however its prompt was split into
cached and new tokens, query chunks, batches and threads."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from prefixcache.model import attention as attention_mod
from prefixcache.model.attention import AttentionMetadata, paged_attention, write_kv_cache

# float32: the kernel and SDPA sum in different orders (measured max difference about 1e-6 on unit-scale
# values). bfloat16: both accumulate in float32 and round the output once; one bfloat16 step at values up to 2
# (2**-7), as the weights are rounded to bfloat16 in both but the softmax itself differs.
TOLERANCES = {torch.float32: (3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.fixture
def kernel() -> None:
    if attention_mod._prefill_kernel() is None:
        pytest.skip("prefixcache's CPU kernels are unavailable here (no compiler, or PREFIXCACHE_NATIVE_KERNELS=0)")


class Step:
    """One step's inputs over a random paged cache: requests with ``computed`` tokens already in their blocks
    (shuffled ids) and ``new`` tokens whose K/V the step writes."""

    def __init__(self, computed, new, heads, kv_heads, head_dim, block_size, dtype, window, seed=0):
        gen = torch.Generator().manual_seed(seed)
        blocks = [-(-(c + n) // block_size) for c, n in zip(computed, new, strict=True)]
        ids = list(range(1, sum(blocks) + 1))  # block 0 stays the null block
        random.Random(seed).shuffle(ids)
        self.tables = [ids[sum(blocks[:r]) : sum(blocks[: r + 1])] for r in range(len(blocks))]
        shape = (sum(blocks) + 1, block_size, kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen).to(dtype)
        self.v_cache = torch.randn(shape, generator=gen).to(dtype)
        self.k_cache[0] = self.v_cache[0] = 0.0  # the null block: padding of the tables
        if window is not None:  # blocks wholly left of the window may be freed and reused: never read
            for table, c in zip(self.tables, computed, strict=True):
                for b in range(max(c - window + 1, 0) // block_size):
                    self.k_cache[table[b]] = self.v_cache[table[b]] = float("nan")
        tokens = sum(new)
        self.query = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
        self.key = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
        self.value = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
        self.args = (computed, new, block_size, window)

    def attend(self) -> tuple[AttentionMetadata, torch.Tensor]:
        computed, new, block_size, window = self.args
        metadata = AttentionMetadata.build(self.tables, computed, new, block_size, "cpu", window)
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        scale = self.query.shape[-1] ** -0.5
        write_kv_cache(self.key, self.value, k_cache, v_cache, metadata.slot_mapping)
        out = paged_attention(self.query, self.key, self.value, k_cache, v_cache, metadata, scale, window)
        return metadata, out


def count_sdpa_prefills(monkeypatch: pytest.MonkeyPatch, amx: bool) -> list[int]:
    """Pretend this CPU has AMX tiles or not; the list grows by one each time a layer's prefill runs through
    torch's flash attention (``_sdpa_prefill``) rather than the kernel."""
    calls: list[int] = []
    sdpa_prefill = attention_mod._sdpa_prefill
    monkeypatch.setattr(attention_mod, "amx_tiles", lambda: amx)
    monkeypatch.setattr(attention_mod, "_sdpa_prefill", lambda *a: calls.append(1) or sdpa_prefill(*a))
    return calls


# (dtype, a CPU with AMX tiles, whether the prefills run through torch's flash attention rather than the kernel)
PREFILL_PATHS = [(torch.float32, False, False), (torch.float32, True, False), (torch.bfloat16, False, False)]
PREFILL_PATHS.append((torch.bfloat16, True, True))


@pytest.mark.parametrize(("dtype", "amx", "by_sdpa"), PREFILL_PATHS)
@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 32), (6, 2, 64), (8, 1, 24)])
def test_kernel_matches_the_torch_path(
    kernel, heads, kv_heads, head_dim, block_size, window, dtype, amx, by_sdpa, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several requests in one step: a fresh prompt, chunks after cached prefixes (unaligned too), a decode (on
    its group's path) and a two-token step; MHA, GQA and MQA; windows shorter and longer than the tiles. In
    bfloat16 on a CPU with AMX tiles the prefills run through torch's flash attention, one call a request, and
    must agree as closely; with a window the blocks left of it hold NaN (freed), which neither path reads."""
    sdpa_calls = count_sdpa_prefills(monkeypatch, amx)
    step = Step([0, 13, 32, 45, 70], [37, 20, 1, 70, 2], heads, kv_heads, head_dim, block_size, dtype, window)
    metadata, ours = step.attend()
    assert metadata.prefill_requests is not None and metadata.prefill_requests.tolist() == [0, 1, 3, 4]
    assert len(sdpa_calls) == by_sdpa
    monkeypatch.setattr(attention_mod, "_prefill_kernel", lambda: None)
    torch_metadata, expected = step.attend()
    assert torch_metadata.prefill_requests is None and torch_metadata.beside_prefill is None
    assert torch.isfinite(ours).all()
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(ours, expected, atol=atol, rtol=rtol)


def group_rows(groups) -> list[int]:
    """The batch rows the groups attend."""
    rows = []
    for group in groups:
        rows += list(range(*group.token_slice)) if group.token_slice else group.token_index.tolist()
    return sorted(rows)


def test_the_kernel_takes_the_prefills_and_groups_keep_the_decodes(kernel) -> None:
    meta = AttentionMetadata.build([[7, 2, 9], [4], [5, 6, 0, 3], [1]], [5, 0, 8, 2], [3, 2, 1, 1], 4, "cpu")
    assert meta.prefill_requests is not None and meta.prefill_requests.tolist() == [0, 1]
    assert meta.beside_prefill is not None and group_rows(meta.beside_prefill) == [5, 6]
    assert all(group.max_q == 1 for group in meta.beside_prefill)
    assert group_rows(meta.groups) == list(range(7))  # torch's path, for a dtype the kernel does not take
    decodes = AttentionMetadata.build([[7], [4]], [2, 3], [1, 1], 4, "cpu")
    assert decodes.prefill_requests is None and decodes.beside_prefill is None


@pytest.mark.parametrize(
    ("query_dtype", "cache_dtype"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)]
)
def test_queries_of_another_dtype_than_the_cache(
    kernel, query_dtype, cache_dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel reads each in its own dtype (the output is the query's), as torch's path converts."""
    step = Step([0, 13, 40], [30, 20, 9], 6, 2, 32, 16, cache_dtype, window=None)
    step.query, step.key, step.value = (t.to(query_dtype) for t in (step.query, step.key, step.value))
    _, ours = step.attend()
    monkeypatch.setattr(attention_mod, "_prefill_kernel", lambda: None)
    _, expected = step.attend()
    assert ours.dtype == query_dtype
    torch.testing.assert_close(ours, expected, atol=1.6e-2, rtol=1.6e-2)


def test_a_dtype_the_kernel_does_not_take_runs_on_the_torch_path(kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    step = Step([0, 13, 5], [9, 20, 1], 4, 2, 16, 4, torch.float64, window=None)
    _, ours = step.attend()
    monkeypatch.setattr(attention_mod, "_prefill_kernel", lambda: None)
    _, expected = step.attend()
    assert torch.equal(ours, expected)


PROMPT, BLOCK = 150, 16


def splits() -> Iterator[tuple[int, list[int]]]:
    """(cached tokens, new tokens of each step after them): cached at block boundaries, queries cut anywhere
    into runs of at least 2 (a single new token is a decode's: the decode path attends it)."""
    for cached in (0, 16, 48, 96, 144):
        rest = PROMPT - cached
        yield cached, [rest]
        if rest > 8:
            yield cached, [7, rest - 7]
            yield cached, [2, 3, 33, rest - 38] if rest > 40 else [rest // 2, rest - rest // 2]


@pytest.mark.parametrize("window", [None, 40])
def test_a_query_s_output_does_not_depend_on_how_its_prompt_was_split(kernel, window) -> None:
    """The same prompt (fixed Q/K/V per position, float32, GQA of 3) as one step, and after cached prefixes of
    several block counts with its new tokens cut into different query chunks, beside another request, at 1 and 2
    threads: every query's output equals the one-step output bit for bit."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim = 6, 2, 64
    q = torch.randn(PROMPT, heads, head_dim, generator=gen)
    k = torch.randn(PROMPT, kv_heads, head_dim, generator=gen)
    v = torch.randn(PROMPT, kv_heads, head_dim, generator=gen)
    other = torch.randn(3, 50, heads, head_dim, generator=gen)  # a neighbour's Q, K and V rows
    blocks = -(-PROMPT // BLOCK)
    table = list(range(1, blocks + 1))
    other_table = list(range(blocks + 1, blocks + 5))
    scale = head_dim**-0.5

    def run(cached: int, steps: list[int], with_neighbour: bool) -> torch.Tensor:
        k_cache = torch.zeros(blocks + 5, BLOCK, kv_heads, head_dim)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached)], dtype=torch.long)
        k_cache.view(-1, kv_heads, head_dim)[slots] = k[:cached]
        v_cache.view(-1, kv_heads, head_dim)[slots] = v[:cached]
        outs, done = [], cached
        for n in steps:
            rows = slice(done, done + n)
            query, key, value = q[rows], k[rows], v[rows]
            tables, computed, new = [table], [done], [n]
            if with_neighbour:
                query = torch.cat([other[0], query])
                key = torch.cat([other[1].view(50, kv_heads, -1)[:, :, :head_dim], key])
                value = torch.cat([other[2].view(50, kv_heads, -1)[:, :, :head_dim], value])
                tables, computed, new = [other_table, table], [0, done], [50, n]
            meta = AttentionMetadata.build(tables, computed, new, BLOCK, "cpu", window)
            write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)
            out = paged_attention(query, key, value, k_cache, v_cache, meta, scale, window)
            outs.append(out[-n:])
            done += n
        return torch.cat(outs)

    whole = run(0, [PROMPT], with_neighbour=False)
    threads = torch.get_num_threads()
    try:
        for cached, steps in splits():
            for num_threads, with_neighbour in ((1, False), (2, True)):
                torch.set_num_threads(num_threads)
                got = run(cached, steps, with_neighbour)
                assert torch.equal(got, whole[cached:]), (cached, steps, num_threads)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: a.update(block_tables=a["block_tables"][:, :1]), "block table is shorter"),
        (lambda a: a["block_tables"].fill_(99), "block id 99 out of range"),
        (lambda a: a.update(requests=torch.tensor([5])), "out of range"),
        (lambda a: a.update(k_cache=a["k_cache"][:, :, :1]), "multiple of the cache's KV heads|contiguous"),
        (lambda a: a.update(window=0), "window must be positive"),
    ],
)
def test_the_kernel_refuses_inconsistent_inputs(kernel, change, match: str) -> None:
    args = {
        "query": torch.randn(5, 4, 8),
        "k_cache": torch.randn(4, 4, 2, 8),
        "v_cache": torch.randn(4, 4, 2, 8),
        "block_tables": torch.tensor([[1, 2]]),
        "query_start_loc": torch.tensor([0, 5]),
        "seq_lens": torch.tensor([7]),
        "requests": torch.tensor([0]),
        "scale": 0.3,
        "window": None,
    }
    change(args)
    with pytest.raises(RuntimeError, match=match):
        attention_mod._prefill_kernel()(**args)


def test_the_kernel_traces_as_one_opaque_op(kernel) -> None:
    """Its fake implementation gives the output's shape without running it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = attention_mod._prefill_kernel()(
            torch.empty(5, 4, 8),
            torch.empty(4, 4, 2, 8),
            torch.empty(4, 4, 2, 8),
            torch.zeros(1, 2, dtype=torch.long),
            torch.tensor([0, 5]),
            torch.tensor([7]),
            torch.tensor([0]),
            0.3,
            None,
        )
    assert out.shape == (5, 32)
