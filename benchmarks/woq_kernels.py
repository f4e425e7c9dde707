"""How fast the quantized linear layers read their weights at SmolLM2-135M's shapes, against a plain read.

A decode step at batch 1 is bounded by the bytes it reads, so each weight-only product is compared with a
streaming read (``sum``) of the same number of bytes. Measured per shape, at 1 row (and ``--rows``):

- ``Int4Linear`` eager: torch's ``_weight_int4pack_mm_for_cpu`` (what ``--quantization gguf`` runs);
- the same product written as plain torch ops and fused by inductor (unpack the nibbles, scale, reduce; the
  fastest of the formulations tried, on a nibble layout of its own), the candidate a compiled step could use;
- ``Int8Linear`` (the tied head, 49152 x 576) eager (``_weight_int8pack_mm``) and compiled (its one-row fused
  reduction), and inductor's own weight-only int8 GEMM template (``freezing`` + ``max_autotune``);
- ``GGUFLinear`` ("native"): prefixcache's own kernels (``native/gguf_matmul.cpp``: int8 activations, VNNI
  integer dot products), Q4_1 for the layers and Q8_0 for the head, as SmolLM2's GGUF has them.

``--crossover`` times, per layer shape, the native kernel against torch's int4 kernel and bfloat16's ``F.linear``
(on a dequantized copy) from 1 row to a prefill's 256, to find where each is fastest.

Each product cycles through enough distinct weights to stream them from memory rather than the L3 cache. On one
thread the times are the thread's CPU time (robust on a shared, loaded host); on more, wall-clock time.
Run: ``PYTHONPATH=src python benchmarks/woq_kernels.py --threads 1`` (a few minutes; ``--no-template`` skips
the autotuned template, which compiles for about a minute, ``--no-inductor`` every compiled column).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from prefixcache.model.quantization import GROUP_SIZE, GGUFLinear, Int4Linear, Int8Linear, gguf_ops

LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD_SHAPE = (49152, 576)
STREAM_BYTES = 64e6  # distinct weights per shape: twice the 32 MB L3 of the host these numbers came from


def timed(fn: Callable[[], object], clock: Callable[[], float], reps: int = 7) -> float:
    """Median seconds of ``fn`` after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def fused_int4(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` with ``w = scale * q + minimum`` from nibbles ``[N, K / 32, 16]`` (byte ``i`` of a group holds
    ``q[i]`` and ``q[i + 16]``) and float32 group ``scale``/``minimum`` ``[N, K / 32]``: x as float32, the
    minimum's term as its own small reduction (the leanest of the loops inductor was given)."""
    rows, groups = x.shape[0], packed.shape[1]
    halves = x.view(rows, 1, groups, 2, 16)
    nibbles = packed.int()
    dots = (nibbles & 15).float() * halves[:, :, :, 0] + (nibbles >> 4).float() * halves[:, :, :, 1]
    return (dots * scale[:, :, None]).sum((-1, -2)) + (minimum * halves.sum((-1, -2))).sum(-1)


def nibble_layout(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, ...]:
    n, k = q.shape
    groups = q.view(n, k // GROUP_SIZE, 2, 16).to(torch.uint8)
    return (groups[:, :, 0] | groups[:, :, 1] << 4).contiguous(), scale.float(), minimum.float()


def native_layer(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None) -> GGUFLinear | None:
    """The native kernel's layer for the same weight (float16 scales), or None where the kernels are unavailable."""
    if gguf_ops() is None:
        return None
    half = scale.half().float().numpy()
    return GGUFLinear(q.numpy(), half, None if minimum is None else minimum.half().float().numpy(), None)


def int4_shape(name: str, n: int, k: int, rows: list[int], clock: Callable[[], float], inductor: bool) -> None:
    nbytes = n * k // 2 + n * (k // GROUP_SIZE) * 4  # nibbles plus bfloat16 scale and zero
    copies = int(STREAM_BYTES // nbytes) + 1
    raw = [
        (torch.randint(0, 16, (n, k), dtype=torch.uint8), torch.rand(n, k // GROUP_SIZE) * 0.01 + 1e-3)
        for _ in range(copies)
    ]
    raw = [(q, scale, -8 * scale) for q, scale in raw]
    flat = torch.rand(copies, nbytes // 4)
    read = timed(lambda: flat.sum(-1), clock) / copies
    layers = [Int4Linear(q, scale, minimum, None, "cpu") for q, scale, minimum in raw]
    natives = [native_layer(q, scale, minimum) for q, scale, minimum in raw]
    stacked = [torch.stack(parts) for parts in zip(*(nibble_layout(*r) for r in raw), strict=True)]
    fused = torch.compile(torch.vmap(fused_int4, in_dims=(None, 0, 0, 0)), dynamic=False, fullgraph=True)
    line = f"{name:8s} {n}x{k}: read {nbytes / read / 1e9:5.1f} GB/s"
    for m in rows:
        x = torch.randn(m, k).to(torch.bfloat16)
        kernel = timed(lambda x=x: [layer(x) for layer in layers], clock) / copies
        line += f" | {m} row(s): kernel {nbytes / kernel / 1e9:5.1f}"
        if inductor:
            inductor_s = timed(lambda x=x: fused(x.float(), *stacked), clock) / copies
            line += f", inductor-fused {nbytes / inductor_s / 1e9:5.1f}"
        if natives[0] is not None:
            native_s = timed(lambda x=x: [layer(x) for layer in natives], clock) / copies
            line += f", native {nbytes / native_s / 1e9:5.1f}"
    print(line + " GB/s", flush=True)


class KernelOnly(torch.nn.Module):
    """An :class:`Int8Linear`'s weights behind the bare kernel, the pattern inductor's template replaces."""

    def __init__(self, table: Int8Linear) -> None:
        super().__init__()
        self.register_buffer("q", table.q)
        self.register_buffer("scale", table.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)


def head(rows: list[int], clock: Callable[[], float], template: bool, inductor: bool) -> None:
    n, k = HEAD_SHAPE
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    table = Int8Linear(q, torch.rand(n) * 0.01, None, "cpu")
    native = native_layer(q, torch.rand(n, k // GROUP_SIZE) * 0.01, None)  # Q8_0: a float16 scale a block more
    native_bytes = n * k + n * k // GROUP_SIZE * 2
    flat = torch.rand(n * k // 4)
    line = f"head     {n}x{k} int8: read {n * k / timed(flat.sum, clock) / 1e9:5.1f} GB/s"
    compiled = torch.compile(table, dynamic=False)
    for m in rows:
        x = torch.randn(m, k).to(torch.bfloat16)
        eager = timed(lambda x=x: table(x), clock)
        line += f" | {m} row(s): kernel {n * k / eager / 1e9:5.1f}"
        if inductor:
            line += f", compiled {n * k / timed(lambda x=x: compiled(x), clock) / 1e9:5.1f}"
        if native is not None:
            line += f", native {native_bytes / timed(lambda x=x: native(x), clock) / 1e9:5.1f}"
    if template:
        x = torch.randn(1, k).to(torch.bfloat16)
        plain = KernelOnly(table).eval()
        options = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
        with torch.no_grad():
            tuned = torch.compile(plain, options=options)
            line += f" | 1 row, freezing + max-autotune template {n * k / timed(lambda: tuned(x), clock) / 1e9:5.1f}"
    print(line + " GB/s", flush=True)


def crossover(rows: list[int], clock: Callable[[], float]) -> None:
    """Milliseconds per product at each row count: native, torch's int4 kernel, bfloat16 ``F.linear``."""
    for name, (n, k) in LAYER_SHAPES.items():
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scale = torch.rand(n, k // GROUP_SIZE) * 0.01 + 1e-3
        minimum = -8 * scale
        int4, native = Int4Linear(q, scale, minimum, None, "cpu"), native_layer(q, scale, minimum)
        dense = q.float() * scale.repeat_interleave(GROUP_SIZE, 1) + minimum.repeat_interleave(GROUP_SIZE, 1)
        dense = dense.bfloat16()
        products = (native, int4, lambda x, dense=dense: F.linear(x, dense))
        line = f"{name:8s} {n}x{k} ms (native / int4 / bf16):"
        for m in rows:
            x = torch.randn(m, k).to(torch.bfloat16)
            times = [timed(lambda x=x, f=f: f(x), clock) * 1e3 for f in products]
            line += f" | {m}: " + " / ".join(f"{t:.3f}" for t in times)
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,4", help="comma-separated row counts")
    parser.add_argument("--no-template", action="store_true", help="skip the autotuned int8 template")
    parser.add_argument("--no-inductor", action="store_true", help="skip every compiled column")
    parser.add_argument("--crossover", default="", help="comma-separated row counts: native against int4 and bf16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    rows = [int(r) for r in args.rows.split(",")]
    print(
        f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s), "
        f"{'thread CPU' if args.threads == 1 else 'wall'} time; GB/s of the weights' bytes"
    )
    for name, (n, k) in LAYER_SHAPES.items():
        int4_shape(name, n, k, rows, clock, not args.no_inductor)
    head(rows, clock, not args.no_template and not args.no_inductor, not args.no_inductor)
    if args.crossover:
        crossover([int(r) for r in args.crossover.split(",")], clock)


if __name__ == "__main__":
    main()
