"""prefixcache's GGUF matmul kernels (``native/gguf_matmul.cpp`` behind ``GGUFLinear``) against the dequantized
float reference: exactly the product of the weights with the activations quantized per block of 32 to int8 (up
to float32 summation order), and within int8's rounding of the float product."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixcache.model.quantization import GROUP_SIZE, GGUFLinear, gguf_ops

pytestmark = pytest.mark.skipif(gguf_ops() is None, reason="prefixcache's native CPU kernels are unavailable")

# SmolLM2-135M's products (QKV, O, gate-up, down, the tied head) and sizes the tiles pad (N not a multiple of 16,
# a single block of K).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (7, 96), (33, 32), (50, 160)]
ROWS = [1, 3, 17, 64]
# Per block of 32 the activations round to 1/254 of their largest magnitude; on Gaussian activations the products
# stay within 1.5% of the float product (relative to its norm; measured 0.5-0.7%).
INT8_RELATIVE_ERROR = 0.015


def random_weight(kind: str, n: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """``(q, scale, minimum)`` of a Q4_0-, Q4_1- or Q8_0-like weight (float16-exact scales, as in a GGUF)."""
    scale = (rng.random((n, k // GROUP_SIZE)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    if kind == "Q8_0":
        return rng.integers(-128, 128, (n, k)).astype(np.int8), scale, None
    minimum = -8 * scale if kind == "Q4_0" else (-rng.random(scale.shape) * 0.1).astype(np.float16).astype(np.float32)
    return rng.integers(0, 16, (n, k)).astype(np.uint8), scale, minimum


def dequantized(q: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None) -> torch.Tensor:
    w = torch.from_numpy(q).float() * torch.from_numpy(scale).repeat_interleave(GROUP_SIZE, 1)
    return w if minimum is None else w + torch.from_numpy(minimum).repeat_interleave(GROUP_SIZE, 1)


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernel sees it: per block of 32, ``round(x / d) * d`` with ``d = amax / 127``."""
    blocks = x.float().view(x.shape[0], -1, GROUP_SIZE)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    return (torch.round(blocks * inverse) * step).view(x.shape)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_kernel_equals_the_dequantized_product(kind: str, n: int, k: int) -> None:
    rng = np.random.default_rng(n * k)
    q, scale, minimum = random_weight(kind, n, k, rng)
    layer = GGUFLinear(q, scale, minimum, None)
    weight = dequantized(q, scale, minimum)
    for rows in ROWS:
        x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
        out = layer(x)
        assert out.shape == (rows, n) and out.dtype == torch.float32
        exact = int8_activations(x) @ weight.t()
        torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))
        float_product = x @ weight.t()
        assert (out - float_product).norm() / float_product.norm() < INT8_RELATIVE_ERROR


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_activations_give_their_dtype(dtype: torch.dtype) -> None:
    """A bfloat16 (or float16) model's hidden states go in as they are and come out in their dtype, rounded once."""
    rng = np.random.default_rng(0)
    q, scale, minimum = random_weight("Q4_1", 64, 256, rng)
    layer = GGUFLinear(q, scale, minimum, None)
    x = torch.from_numpy(rng.standard_normal((5, 256)).astype(np.float32)).to(dtype)
    out = layer(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, layer(x.float()).to(dtype), rtol=0, atol=0)


def test_a_bias_and_leading_dimensions() -> None:
    rng = np.random.default_rng(1)
    q, scale, _ = random_weight("Q8_0", 20, 64, rng)
    bias = torch.randn(20)
    layer = GGUFLinear(q, scale, None, bias)
    x = torch.randn(2, 3, 64)
    expected = int8_activations(x.reshape(6, 64)) @ dequantized(q, scale, None).t() + bias
    torch.testing.assert_close(layer(x), expected.view(2, 3, 20), rtol=1e-5, atol=1e-5)


def test_rows_of_a_q8_table_are_the_dequantized_rows() -> None:
    """The tied embedding looks its rows up from the same tiles the output projection reads."""
    rng = np.random.default_rng(2)
    q, scale, _ = random_weight("Q8_0", 50, 96, rng)
    table = GGUFLinear(q, scale, None, None)
    ids = torch.tensor([[0, 17, 49], [33, 33, 2]])
    rows = table.rows(ids, torch.float32)
    assert rows.shape == (2, 3, 96)
    torch.testing.assert_close(rows, dequantized(q, scale, None)[ids], rtol=0, atol=0)
    q4, scale4, minimum4 = random_weight("Q4_1", 16, 32, rng)
    with pytest.raises(TypeError, match="Q8_0 table"):
        GGUFLinear(q4, scale4, minimum4, None).rows(ids, torch.float32)


def test_the_packed_weights_take_at_most_the_ggufs_bytes_and_a_ninth() -> None:
    """Q4_1 and Q8_0 tiles hold exactly the GGUF's bytes (20 / 34 a block of 32), Q4_0's an explicit minimum more
    (20 against 18), rows padded to a tile of 16 aside."""
    rng = np.random.default_rng(3)
    for kind, gguf_block_bytes in (("Q4_0", 18), ("Q4_1", 20), ("Q8_0", 34)):
        layer = GGUFLinear(*random_weight(kind, 64, 576, rng), None)
        gguf_bytes = 64 * 576 // GROUP_SIZE * gguf_block_bytes
        assert layer.packed.numel() <= gguf_bytes * 1.12


def test_bad_inputs_are_clear_errors() -> None:
    rng = np.random.default_rng(4)
    layer = GGUFLinear(*random_weight("Q4_0", 16, 64, rng), None)
    with pytest.raises(RuntimeError, match="x has K = 32 but the weights 64"):
        torch.ops.prefixcache.gguf_q4_matmul(torch.randn(1, 32), layer.packed, 16)
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.prefixcache.gguf_q4_matmul(torch.randn(1, 64), layer.packed, 17)
    with pytest.raises(RuntimeError, match="packed weights must be"):
        torch.ops.prefixcache.gguf_q8_matmul(torch.randn(1, 64), layer.packed, 16)  # a q4 tile is not a q8 one


def test_a_compiled_graph_traces_the_kernel_as_one_op() -> None:
    """The fake implementation lets inductor trace through the op (fullgraph) and call the kernel from its code."""
    rng = np.random.default_rng(5)
    layer = GGUFLinear(*random_weight("Q4_1", 48, 128, rng), None)
    x = torch.randn(3, 128)
    compiled = torch.compile(lambda t: torch.relu(layer(t)) * 2, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x), torch.relu(layer(x)) * 2, rtol=1e-6, atol=1e-6)


PORTABLE_CHECK = """
import sys
import numpy as np
import torch
from torch.utils import cpp_extension

from prefixcache.model.native import _ninja_on_path
from prefixcache.model.quantization import pack_gguf_weight

_ninja_on_path()
cpp_extension.load(name="gguf_portable", sources=[sys.argv[1]], build_directory=sys.argv[2], is_python_module=False,
                   extra_cflags=["-O2", "-march=x86-64-v3", "-std=c++17"])  # AVX2 without AVX-512: the scalar path
rng = np.random.default_rng(0)
for four_bit in (True, False):
    n, k = 37, 96
    scale = (rng.random((n, k // 32)) * 0.02).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (n, k)).astype(np.uint8) if four_bit else rng.integers(-128, 128, (n, k)).astype(np.int8)
    minimum = (-rng.random(scale.shape) * 0.1).astype(np.float16).astype(np.float32) if four_bit else None
    w = torch.from_numpy(q).float() * torch.from_numpy(scale).repeat_interleave(32, 1)
    if four_bit:
        w = w + torch.from_numpy(minimum).repeat_interleave(32, 1)
    x = torch.randn(5, k)
    blocks = x.view(5, -1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    xq = (torch.round(blocks * (1 / step)) * step).view(5, k)
    op = torch.ops.prefixcache.gguf_q4_matmul if four_bit else torch.ops.prefixcache.gguf_q8_matmul
    torch.testing.assert_close(op(x, pack_gguf_weight(q, scale, minimum), n), xq @ w.t(), rtol=1e-5, atol=1e-5)
print("portable ok")
"""


@pytest.mark.slow
def test_the_portable_path_computes_the_same_products(tmp_path) -> None:
    """Built for a CPU without AVX-512 (in a process of its own: the ops' names are the same), the scalar loops
    give the same products over the same tiles."""
    import subprocess
    import sys
    from pathlib import Path

    import prefixcache.model.native as native

    source = Path(native.__file__).parent / "gguf_matmul.cpp"
    result = subprocess.run(
        [sys.executable, "-c", PORTABLE_CHECK, str(source), str(tmp_path)], capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0 and "portable ok" in result.stdout, result.stderr[-3000:]


def test_the_kernels_say_which_path_they_were_built_for(caplog) -> None:
    """The build reports AVX-512 VNNI on a host that has it; a scalar build leaves the GGUF's weights to torch's
    kernels (faster than the scalar loops), and says why."""
    from pathlib import Path

    import prefixcache.model.quantization as quantization

    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    vnni = {"avx512f", "avx512bw", "avx512_vnni"} <= set(flags)
    assert torch.ops.prefixcache.gguf_matmul_isa() == ("avx512-vnni" if vnni else "scalar")

    class ScalarOps:
        def gguf_matmul_isa(self) -> str:
            return "scalar"

    with caplog.at_level("INFO", logger=quantization.__name__):
        assert not quantization._vector_kernels(ScalarOps())
    assert "no AVX-512 VNNI" in caplog.text and "torch's" in caplog.text
    assert quantization._vector_kernels(torch.ops.prefixcache) == vnni
