"""Linear layers on a CPU with their weights laid out once for the kernel that multiplies them, not every call.

bfloat16 on a CPU with AMX tiles: torch's ``F.linear`` runs oneDNN's matmul, which first reorders the weight into
the blocked layout its AMX kernels read, on every call: at a decode step's few rows that reorder costs more than
the product. ``torch.ops.mkldnn._reorder_linear_weight`` makes that layout once and ``_linear_pointwise``
multiplies by it (the same kernel: results equal bit for bit). SmolLM2-135M's shapes on 2 threads of an AMX host,
per product: 1.7-2.5x at 1 row, 1.4-2.7x at 64, 1.0-1.3x at 500 and 0.9-1.06x at 2,048; the layout is made for 64
rows (``_ROWS_HINT``; 1 and 2,048 measured no better at any row count). The layout is an opaque oneDNN tensor,
which ``torch.compile`` cannot lower: only eager engines pack (:meth:`EngineCore`), and a compiled step keeps
torch's ``nn.Linear``.

float32: ``F.linear`` hands MKL's sgemm the weight ``[out, in]`` transposed; stored ``[in, out]`` once, the same
sgemm reads it a little faster at a decode step's rows. SmolLM2-135M's four products of a layer, 30 layers of
distinct weights (``benchmarks/cpu_linear.py``, an Intel host with AVX-512, torch 2.13), torch's time over the
layout's: one thread 1.16-1.17x at 1 row, 1.16x at 4, 1.21-1.24x at 8, 0.97x at 16, 1.06-1.12x at 32,
1.05-1.25x at 64, 1.0x at 2,048; two threads 1.11-1.12x at 1, 0.91-1.01x at 4 to 32, 1.14-1.15x at 64, 0.98x at
2,048. The rounding differs from ``F.linear``'s (another sgemm path; a row's result depends on how many rows
come with it, as with ``F.linear``). A tied vocabulary product keeps torch's path (a copy would cost the
embedding's size again, for 0.85-1.26x); an untied one is transposed as the others are.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

# The row count the packed layout is made for (oneDNN picks its blocking by it).
_ROWS_HINT = 64


@cache
def amx_tiles() -> bool:
    """Whether this CPU (and its OS) lets oneDNN run bfloat16 products on AMX tiles."""
    return torch.cpu._is_amx_tile_supported()


def linear_layout(dtype: torch.dtype, device: torch.device | str) -> type[OneDNNLinear | TransposedLinear] | None:
    """The layer a model of ``dtype`` on ``device`` runs its linear layers as, or None for torch's ``nn.Linear``:
    :class:`OneDNNLinear` in bfloat16 on a CPU with AMX tiles and oneDNN, :class:`TransposedLinear` in float32 on
    a CPU with MKL (measured there; other CPUs and dtypes keep torch's path)."""
    if torch.device(device).type != "cpu":
        return None
    if dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() and amx_tiles():
        return OneDNNLinear
    if dtype == torch.float32 and torch.backends.mkl.is_available():
        return TransposedLinear
    return None


class OneDNNLinear(nn.Module):
    """``y = x @ w.T + b`` with ``w`` in oneDNN's packed layout (see the module docstring); any leading dims."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ROWS_HINT))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._linear = torch.ops.mkldnn._linear_pointwise.default  # the op itself: one dispatch lookup less a call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self._buffers["packed"], self.bias, "none", [], "")

    # Called straight, as GGUFLinear is (no hooks are registered on these layers): nn.Module.__call__'s hook
    # machinery costs about a microsecond a call, and a decode step makes over a hundred.
    __call__ = forward


class TransposedLinear(nn.Module):
    """``y = x @ w.T + b`` with ``w.T`` stored contiguous ``[in, out]`` (see the module docstring); any leading
    dims."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_t", weight.detach().t().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        weight_t = self._buffers["weight_t"]
        y = torch.mm(rows, weight_t) if self.bias is None else torch.addmm(self.bias, rows, weight_t)
        return y.view(*x.shape[:-1], self.out_features)

    __call__ = forward  # as OneDNNLinear's


def pack_linears(model: nn.Module, layout: type[OneDNNLinear | TransposedLinear]) -> int:
    """Replace every ``nn.Linear`` in ``model`` of the dtype ``layout`` is for (bfloat16 or float32) by a
    ``layout`` of the same weight (the original weight is dropped); returns how many."""
    dtype = torch.bfloat16 if layout is OneDNNLinear else torch.float32
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == dtype:
                setattr(parent, name, layout(child.weight, child.bias))
                packed += 1
    return packed
