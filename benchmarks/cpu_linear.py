"""SmolLM2-135M's linear layers as torch's ``nn.Linear`` runs them and on the layout ``model/cpu_linear.py`` gives
their weights (float32: ``TransposedLinear``; bfloat16 on a CPU with AMX tiles: ``OneDNNLinear``), per row count.

A pass is what one step's products are: the four products of a layer (``woq_kernels.LAYER_SHAPES``) for 30
layers of distinct weights, so that they come from memory as in a step, not from the cache. The tied vocabulary
product (49152 x 576, what ``pack_linears`` leaves on torch's path in float32) is timed on its own. Reported: the
best of ``--repeats`` passes, the two layouts alternating, ms a pass and the ratio torch / layout.

    PYTHONPATH=src .venv/bin/python benchmarks/cpu_linear.py [--threads 1,2] [--dtype float32] [--rows 1,8,32]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable

import torch
from torch import nn
from woq_kernels import HEAD_SHAPE, LAYER_SHAPES

from prefixcache.argtypes import positive_int
from prefixcache.bench.decode import parse_sizes
from prefixcache.model.cpu_linear import linear_layout

LAYERS = 30


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """The best wall-clock time of ``repeats`` calls of ``fn``, in ms (one untimed call first)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def compare(torch_layers: list[nn.Module], layout_layers: list[nn.Module], x: torch.Tensor, repeats: int) -> dict:
    """ms of one pass through each list of layers on ``x``, alternating, and their ratio."""

    def run(layers: list[nn.Module]) -> Callable[[], None]:
        def one_pass() -> None:
            for layer in layers:
                layer(x[:, : layer.in_features])

        return one_pass

    torch_ms, layout_ms = float("inf"), float("inf")
    for _ in range(repeats):
        torch_ms = min(torch_ms, best_ms(run(torch_layers), 1))
        layout_ms = min(layout_ms, best_ms(run(layout_layers), 1))
    return {"torch_ms": round(torch_ms, 3), "layout_ms": round(layout_ms, 3), "ratio": round(torch_ms / layout_ms, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=parse_sizes, default=[1, 2])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rows", type=parse_sizes, default=[1, 8, 32, 64, 128, 2048])
    parser.add_argument("--repeats", type=positive_int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    layout = linear_layout(dtype, "cpu")
    if layout is None:
        raise SystemExit(f"cpu_linear.py: {args.dtype} keeps torch's nn.Linear on this CPU; nothing to compare")
    torch.manual_seed(0)
    with torch.inference_mode():
        plain = [
            nn.Linear(in_features, out_features, bias=False, dtype=dtype)
            for _ in range(LAYERS)
            for out_features, in_features in LAYER_SHAPES.values()
        ]
        laid_out = [layout(linear.weight, None) for linear in plain]
        head = [nn.Linear(HEAD_SHAPE[1], HEAD_SHAPE[0], bias=False, dtype=dtype)]
        head_laid_out = [layout(head[0].weight, None)]
        print(
            json.dumps(
                {
                    "machine": platform.processor() or platform.machine(),
                    "dtype": args.dtype,
                    "layout": layout.__name__,
                    "torch": torch.__version__,
                }
            )
        )
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                x = torch.randn(rows, max(shape[1] for shape in LAYER_SHAPES.values()), dtype=dtype)
                layers = compare(plain, laid_out, x, args.repeats)
                vocab = compare(head, head_laid_out, x, args.repeats)
                print(json.dumps({"threads": threads, "rows": rows, "layers": layers, "vocabulary": vocab}))


if __name__ == "__main__":
    main()
