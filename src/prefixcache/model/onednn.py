"""bfloat16 linear layers on a CPU with AMX tiles, their weights laid out for oneDNN once instead of every call.

torch's bfloat16 ``F.linear`` on a CPU runs oneDNN's matmul, which first reorders the weight into the blocked
layout its AMX kernels read, on every call: at a decode step's few rows that reorder costs more than the product.
``torch.ops.mkldnn._reorder_linear_weight`` makes that layout once and ``_linear_pointwise`` multiplies by it
(the same kernel: results equal bit for bit). SmolLM2-135M's shapes on 2 threads of an AMX host, per product:
1.7-2.5x at 1 row, 1.4-2.7x at 64, 1.0-1.3x at 500 and 0.9-1.06x at 2,048; the layout is made for 64 rows
(``_ROWS_HINT``; 1 and 2,048 measured no better at any row count).

The layout is an opaque oneDNN tensor, which ``torch.compile`` cannot lower: only eager engines pack
(:meth:`EngineCore`), and a compiled step keeps torch's ``nn.Linear``.
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


def packs_linears(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a model of ``dtype`` on ``device`` runs its linear layers as :class:`OneDNNLinear`: bfloat16 on a
    CPU with AMX tiles and oneDNN (measured there; other CPUs keep torch's path)."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and amx_tiles()
    )


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


def pack_linears(model: nn.Module) -> int:
    """Replace every bfloat16 ``nn.Linear`` in ``model`` by a :class:`OneDNNLinear` of the same weight (the
    float weight is dropped); returns how many."""
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16:
                setattr(parent, name, OneDNNLinear(child.weight, child.bias))
                packed += 1
    return packed
