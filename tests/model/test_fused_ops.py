"""prefixcache's fused CPU kernels of the decoder (model/native/fused_ops.cpp) against the torch code they replace.

The torch code is the reference and the fallback: the kernels must give its values (exactly where the math is the
same order, else within the stated rounding), and a model without the kernels must still run it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from prefixcache.model import decoder, load_model
from prefixcache.model.attention import write_kv_cache
from prefixcache.model.decoder import _ACTIVATIONS, RMSNorm, fused_ops_loaded, rotate
from tests.model.conftest import VOCAB_SIZE, PagedRunner

pytestmark = pytest.mark.skipif(not fused_ops_loaded(), reason="prefixcache's CPU kernels cannot be built here")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows, width): one token, a width that is no multiple of the 16-float vectors, and enough rows to use threads.
SHAPES = [(1, 576), (5, 100), (300, 576)]


def close_to(dtype: torch.dtype) -> dict[str, float]:
    """The stated tolerance against torch's ops: in bfloat16 and float16 one rounding of the dtype (a float32
    difference moving a rounding); in float32 a few of its roundings (the sum of squares in another order over
    many rows: up to 3 eps relative; tanh-GELU's ``1 + tanh`` cancelling near zero: 8 eps absolute, for values of
    order 1 to 10)."""
    eps = torch.finfo(dtype).eps
    return {"rtol": 4 * eps, "atol": 16 * eps} if dtype == torch.float32 else {"rtol": 2 * eps, "atol": eps}


def rows_in_a_wider_tensor(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``[rows, width]`` values as a view strided across rows, as the fused QKV projection's slices are."""
    wide = torch.randn(rows, width + 24, generator=torch.Generator().manual_seed(seed)) * 3
    return wide.to(dtype)[:, 8 : 8 + width]


def random_norm(width: int, dtype: torch.dtype, unit_offset: bool) -> RMSNorm:
    norm = RMSNorm(width, 1e-5, unit_offset).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=torch.Generator().manual_seed(7)))
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), SHAPES)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_matches_torch(dtype: torch.dtype, rows: int, width: int, unit_offset: bool) -> None:
    norm = random_norm(width, dtype, unit_offset)
    x = rows_in_a_wider_tensor(rows, width, dtype, seed=1)
    fused = norm(x)
    assert fused.is_contiguous() and fused.dtype == dtype
    torch.testing.assert_close(fused, norm._torch_forward(x), **close_to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), SHAPES)
def test_add_rms_norm_writes_the_sum_and_its_norm_in_place(dtype: torch.dtype, rows: int, width: int) -> None:
    norm = random_norm(width, dtype, unit_offset=False)
    x = rows_in_a_wider_tensor(rows, width, dtype, seed=2)
    residual = rows_in_a_wider_tensor(rows, width, dtype, seed=3)
    expected_sum = x + residual
    expected = norm._torch_forward(expected_sum)
    normed, summed = norm.add_forward(x, residual)
    assert normed is x and summed is residual  # in place
    assert torch.equal(summed, expected_sum)  # the residual add is exact: one rounding of the float32 sum
    torch.testing.assert_close(normed, expected, **close_to(dtype))


def rope_tables(positions: torch.Tensor, rotary_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin ``[T, 1, rotary_dim]``, as the decoder builds them (``_rope``)."""
    inv_freq = decoder.rope_inv_freq(rotary_dim, 10000.0, None)
    freqs = (positions[:, None].float() * inv_freq)[:, None, :]
    sin = freqs.sin().to(dtype)
    return torch.cat((freqs, freqs), dim=-1).cos().to(dtype), torch.cat((-sin, sin), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "heads", "head_dim", "rotary_dim"),
    [(1, 12, 64, 64), (7, 5, 80, 80), (40, 3, 64, 32)],  # SmolLM2's Q and K; a half of 40; partial RoPE
)
def test_rotary_embedding_is_the_torch_rotation_in_place(
    dtype: torch.dtype, tokens: int, heads: int, head_dim: int, rotary_dim: int
) -> None:
    """Bit for bit in every dtype (each product and the sum rounded as torch's ops round them), on a view of a
    wider tensor whose other elements stay untouched."""
    qkv = rows_in_a_wider_tensor(tokens, heads * head_dim + 16, dtype, seed=4)
    before = qkv.clone()
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    cos, signed_sin = rope_tables(torch.arange(tokens) * 37 + 5, rotary_dim, dtype)
    expected = rotate(x.clone(), cos, signed_sin, fused=False)
    assert rotate(x, cos, signed_sin, fused=True) is x
    assert torch.equal(x, expected)
    assert torch.equal(qkv[:, heads * head_dim :], before[:, heads * head_dim :])


# (tokens, heads, kv_heads, head_dim, rotary_dim, slots): SmolLM2's GQA decode; a prefill over three blocks of 4,
# in no slot order; MQA with partial RoPE.
KV_WRITES = [
    (1, 9, 3, 64, 64, [13]),
    (6, 4, 2, 32, 32, [8, 1, 2, 3, 30, 17]),
    (3, 6, 1, 80, 40, [5, 0, 31]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "head_dim", "rotary_dim", "slots"), KV_WRITES)
@pytest.mark.parametrize("side_by_side", [True, False])
def test_rotary_kv_write_is_the_rotation_and_the_cache_write(
    dtype: torch.dtype,
    tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    slots: list[int],
    side_by_side: bool,
) -> None:
    """Bit for bit the torch path (:func:`rotate` of Q and K, then :func:`write_kv_cache`): Q and K rotated in
    place, as views of the QKV projection (``side_by_side``) or as tensors of their own (after q/k norms), and
    each token's K and V at its slot, in any block; the other slots untouched."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = rows_in_a_wider_tensor(tokens, q_size + 2 * kv_size, dtype, seed=8)
    if side_by_side:
        q = qkv[:, :q_size].view(tokens, heads, head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    else:
        q = qkv[:, :q_size].reshape(tokens, heads, head_dim).clone()
        k = qkv[:, q_size : q_size + kv_size].reshape(tokens, kv_heads, head_dim).clone()
    v = qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim)
    rows = rope_tables(torch.tensor(slots) * 7 + 3, rotary_dim, dtype)
    cache = torch.randn(8, 4, kv_heads, head_dim, generator=torch.Generator().manual_seed(9)).to(dtype)
    slot_mapping = torch.tensor(slots)
    expected_q, expected_k = rotate(q.clone(), *rows, fused=False), rotate(k.clone(), *rows, fused=False)
    expected_caches = cache.clone(), cache.clone() + 1
    write_kv_cache(expected_k, v, *expected_caches, slot_mapping)
    caches = cache.clone(), cache.clone() + 1
    torch.ops.prefixcache.rotary_kv_write_(q, k, v, *caches, slot_mapping, *rows)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(caches[0], expected_caches[0]) and torch.equal(caches[1], expected_caches[1])


def test_rotary_kv_write_refuses_what_it_cannot_write() -> None:
    q, k, v = torch.randn(2, 4, 32), torch.randn(2, 2, 32), torch.randn(2, 2, 32)
    cos, signed_sin = rope_tables(torch.arange(2), 32, torch.float32)
    caches = torch.zeros(2, 4, 2, 32), torch.zeros(2, 4, 2, 32)
    with pytest.raises(RuntimeError, match="slot 8 of token 1 is outside"):
        torch.ops.prefixcache.rotary_kv_write_(q, k, v, *caches, torch.tensor([0, 8]), cos, signed_sin)
    with pytest.raises(RuntimeError, match="in k's dtype"):
        bf16 = tuple(c.bfloat16() for c in caches)
        torch.ops.prefixcache.rotary_kv_write_(q, k, v, *bf16, torch.tensor([0, 1]), cos, signed_sin)
    with pytest.raises(RuntimeError, match="heads and head_dim"):
        wide = torch.zeros(2, 4, 3, 32), torch.zeros(2, 4, 3, 32)
        torch.ops.prefixcache.rotary_kv_write_(q, k, v, *wide, torch.tensor([0, 1]), cos, signed_sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), SHAPES)
@pytest.mark.parametrize(("activation", "op"), list(decoder._FUSED_ACTIVATIONS.items()))
def test_gated_activation_matches_torch(dtype: torch.dtype, rows: int, width: int, activation: str, op: str) -> None:
    """``act(gate) * up``: SLEEF's exp and tanh as torch's vectorized kernels; float32's last bit may differ (a
    vector tail, and tanh-GELU's order of products), a reduced float's rounding then rarely does."""
    gate_up = rows_in_a_wider_tensor(rows, 2 * width, dtype, seed=5)
    gate, up = gate_up.split(width, dim=-1)
    fused = getattr(torch.ops.prefixcache, op)(gate_up)
    torch.testing.assert_close(fused, _ACTIVATIONS[activation](gate) * up, **close_to(dtype))


def c10_bfloat16_bits(values: torch.Tensor) -> torch.Tensor:
    """float32 values rounded to bfloat16 as c10 rounds a scalar (to nearest even, denormals too; every NaN to the
    canonical 0x7FC0), as int16 bits: the kernels' reference, written out in integers."""
    bits = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = torch.where(values.isnan(), 0x7FC0, rounded)
    return torch.where(rounded >= 0x8000, rounded - 0x10000, rounded).to(torch.int16)


def test_bfloat16_results_round_as_c10_with_nans_and_denormals() -> None:
    """The kernels' bfloat16 store (vcvtneps2bf16 where the host has AVX512-BF16) rounds as c10 does also where
    that instruction does not: NaNs of any payload become the canonical NaN, denormal results round instead of
    flushing to zero. The residual add's result is one rounding of the float32 sum: compared bit for bit."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(64, 100, generator=g).to(torch.bfloat16)
    residual = torch.randn(64, 100, generator=g).to(torch.bfloat16)
    specials = torch.tensor([1e-39, -3e-40, 2e-38, -1e-45, float("inf"), float("-inf"), 3e38]).to(torch.bfloat16)
    x[::3, ::7] = specials[torch.arange(15) % len(specials)]  # denormal, infinite and overflowing sums
    residual[1::3, ::5] = torch.tensor([0x7FC1, 0x7F81, -0x60], dtype=torch.int16).view(torch.bfloat16)[
        torch.arange(20) % 3
    ]  # NaNs with payloads: quiet, signalling, negative
    expected = c10_bfloat16_bits(x.float() + residual.float())
    assert (expected.view(torch.bfloat16).float().abs() < torch.finfo(torch.float32).tiny).any()  # denormals
    torch.ops.prefixcache.add_rms_norm_(x, residual, torch.ones(100, dtype=torch.bfloat16), 1e-5, False)
    assert torch.equal(residual.view(torch.int16), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_the_batch_or_threads(dtype: torch.dtype) -> None:
    """Each row is computed alone: the same token gives the same values in a decode step and in a long prefill
    split over threads (what makes outputs with and without the prefix cache identical)."""
    norm = random_norm(576, dtype, unit_offset=False)
    x = rows_in_a_wider_tensor(512, 576, dtype, seed=6)
    residual = rows_in_a_wider_tensor(512, 576, dtype, seed=7)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        normed, summed = norm.add_forward(x.clone(), residual.clone())
        activated = torch.ops.prefixcache.silu_and_mul(torch.cat((x, residual), dim=-1))
    finally:
        torch.set_num_threads(threads)
    for row in (0, 255, 511):
        alone, alone_sum = norm.add_forward(x[row : row + 1].clone(), residual[row : row + 1].clone())
        assert torch.equal(alone, normed[row : row + 1]) and torch.equal(alone_sum, summed[row : row + 1])
        pair = torch.cat((x[row : row + 1], residual[row : row + 1]), dim=-1)
        assert torch.equal(torch.ops.prefixcache.silu_and_mul(pair), activated[row : row + 1])


def test_kernels_refuse_what_they_cannot_compute() -> None:
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="weight dtype"):
        torch.ops.prefixcache.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-5, False)
    with pytest.raises(RuntimeError, match="last dim contiguous"):
        torch.ops.prefixcache.rms_norm(x.t(), torch.ones(2), 1e-5, False)
    cos, signed_sin = rope_tables(torch.arange(2), 64, torch.float32)
    with pytest.raises(RuntimeError, match="rotary_dim <= head_dim"):
        torch.ops.prefixcache.rotary_embedding_(torch.randn(2, 3, 32), cos, signed_sin)
    with pytest.raises(RuntimeError, match="even last dim"):
        torch.ops.prefixcache.silu_and_mul(torch.randn(2, 7))


class _PrefixcacheOps(TorchDispatchMode):
    """The prefixcache kernels a block of code calls, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.called: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace == "prefixcache":
            self.called.add(func._opname)
        return func(*args, **(kwargs or {}))


def greedy_logits(model: decoder.DecoderForCausalLM, steps: int = 3) -> list[torch.Tensor]:
    """A prompt, then ``steps`` greedy decode steps: each step's logits."""
    runner = PagedRunner(model, block_size=4)
    tokens = torch.randint(0, VOCAB_SIZE, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    out = [runner.step([("a", tokens)])["a"]]
    for _ in range(steps):
        out.append(runner.step([("a", [int(out[-1][-1].argmax())])])["a"])
    return out


FUSED_OPS = {"rms_norm", "add_rms_norm_", "rotary_embedding_", "rotary_kv_write_", "silu_and_mul", "gelu_tanh_and_mul"}


# Llama's RoPE of Q and K together; Qwen3's q/k norms; Gemma 3's sandwich and unit-offset norms and tanh-GELU.
@pytest.mark.parametrize(
    ("kind", "ops"),
    [
        ("llama", {"rms_norm", "add_rms_norm_", "rotary_kv_write_", "silu_and_mul"}),
        ("qwen3_window", {"rms_norm", "add_rms_norm_", "rotary_kv_write_", "silu_and_mul"}),
        ("gemma3", {"rms_norm", "add_rms_norm_", "rotary_kv_write_", "gelu_tanh_and_mul"}),
    ],
)
def test_model_with_the_kernels_computes_the_torch_fallback(
    kind: str, ops: set[str], checkpoint_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float32 model runs its norms, RoPE and activation as the kernels, and a model built where they are
    unavailable (``native_ops()`` None) runs torch's ops alone; their logits agree to float32 rounding and
    their greedy tokens are the same."""
    fused = load_model(checkpoint_dirs[kind]).model
    with monkeypatch.context() as patch:
        patch.setattr(decoder, "native_ops", lambda: None)
        fallback = load_model(checkpoint_dirs[kind]).model
    with _PrefixcacheOps() as fused_calls:
        fused_logits = greedy_logits(fused)
    with _PrefixcacheOps() as fallback_calls:
        fallback_logits = greedy_logits(fallback)
    # The attention kernels run in both models: only the fused kernels' calls tell them apart.
    assert fused_calls.called & FUSED_OPS == ops
    assert fallback_calls.called & FUSED_OPS == set()
    for ours, theirs in zip(fused_logits, fallback_logits, strict=True):
        assert ours.argmax(-1).tolist() == theirs.argmax(-1).tolist()
        # The norms' sums of squares differ by a few float32 roundings, and the layers carry that to the logits
        # (1.1e-5 seen on Gemma 3's, whose sandwich norms run 4 a layer).
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


def test_bfloat16_model_with_the_kernels_stays_near_the_fallback(
    checkpoint_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In bfloat16 every value the fallback rounds is rounded at the same point, so the layers differ only where
    a sum of squares' last float32 bit moves a rounding: logits within bfloat16's resolution of the logits'
    scale."""
    fused = load_model(checkpoint_dirs["llama"], dtype=torch.bfloat16).model
    with monkeypatch.context() as patch:
        patch.setattr(decoder, "native_ops", lambda: None)
        fallback = load_model(checkpoint_dirs["llama"], dtype=torch.bfloat16).model
    for ours, theirs in zip(greedy_logits(fused), greedy_logits(fallback), strict=True):
        torch.testing.assert_close(ours, theirs, atol=2**-6 * theirs.abs().max().item(), rtol=2**-7)
