"""One decode step's attention of SmolLM2-135M's shapes (9 query heads, 3 KV heads of 64) in prefixcache's
paged decode kernel, per layer, for batches that share a prefix in the cache and the same batches with private
copies of every block (what the kernel reads with the prefix cache off), so the share's saving shows in one tree.

Each case is a batch of requests, their lengths, and how many leading blocks they share: none; pairs that share
every block (a prompt sent twice); a common prefix. Every layer has caches of its own (``--layers``), so that
the rows come from memory as in a step rather than from the last layer's call. Reported: the best of
``--repeats`` passes over all layers, ms a layer, the shared and the private tables alternating.

    PYTHONPATH=src .venv/bin/python benchmarks/shared_splits.py [--threads 1,2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from prefixcache.argtypes import positive_int
from prefixcache.bench.decode import parse_sizes
from prefixcache.model.native import native_ops

BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 16, 9, 3, 64

# name: (lengths of the batch's requests, leading blocks shared, whether requests share in pairs instead)
CASES = {
    "32 x 400, nothing shared": ([400] * 32, 0, False),
    "16 pairs x 400, each pair all shared": ([400] * 32, 0, True),
    "64 x 516, the first 400 shared": ([516] * 64, 25, False),
    "16 x 640, the first 512 shared": ([640] * 16, 32, False),
}


def shared_tables(lens: list[int], shared_blocks: int, pairs: bool) -> tuple[torch.Tensor, int]:
    """Block tables with the first ``shared_blocks`` blocks common to all (or every block to each pair), and the
    number of blocks they use (block 0 unused, as the engine's null block)."""
    width = max(-(-n // BLOCK_SIZE) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    used = 1 + shared_blocks
    for r, n in enumerate(lens):
        if pairs and r % 2:
            tables[r] = tables[r - 1]
            continue
        for i in range(-(-n // BLOCK_SIZE)):
            if i < shared_blocks:
                tables[r, i] = 1 + i
            else:
                tables[r, i], used = used, used + 1
    return tables, used


def private_tables(tables: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The same requests with blocks of their own: new tables, and for each new block the block it copies."""
    copies, private = [0], torch.zeros_like(tables)
    for r, n in enumerate(lens):
        for i in range(-(-n // BLOCK_SIZE)):
            private[r, i] = len(copies)
            copies.append(int(tables[r, i]))
    return private, copies


def layer_ms(query, caches, tables, seq_lens, repeats: int) -> float:
    """Best of ``repeats`` passes over every layer's caches, ms a layer."""
    attend = torch.ops.prefixcache.paged_decode_attention
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            attend(query, k_cache, v_cache, tables, seq_lens, HEAD_DIM**-0.5, None)
        best = min(best, (time.perf_counter() - start) / len(caches) * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=parse_sizes, default=[1, 2])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--layers", type=positive_int, default=30)
    parser.add_argument("--repeats", type=positive_int, default=5)
    args = parser.parse_args()
    if native_ops() is None:
        raise SystemExit("prefixcache's CPU kernels are not built on this machine (see the log above)")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    report = {"machine": platform.processor() or platform.machine(), "dtype": args.dtype, "cases": {}}
    print(f"{args.dtype}, {args.layers} layers, ms a layer (best of {args.repeats}); shared tables / private copies")
    for name, (lens, shared_blocks, pairs) in CASES.items():
        tables, used = shared_tables(lens, shared_blocks, pairs)
        private, copies = private_tables(tables, lens)
        shape = (used, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        caches = [tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(2)) for _ in range(args.layers)]
        copied = [tuple(cache[copies] for cache in pair) for pair in caches]
        query = torch.randn(len(lens), HEADS, HEAD_DIM, generator=gen).to(dtype)
        seq_lens = torch.tensor(lens)
        for threads in args.threads:
            torch.set_num_threads(threads)
            times = {"shared": [], "private": []}
            for _ in range(2):  # alternating, twice each
                times["shared"].append(layer_ms(query, caches, tables, seq_lens, args.repeats))
                times["private"].append(layer_ms(query, copied, private, seq_lens, args.repeats))
            result = {kind: min(values) for kind, values in times.items()}
            report["cases"][f"{name}, {threads} thread(s)"] = result
            print(
                f"{name:38s} {threads} thread(s): {result['shared']:.3f} / {result['private']:.3f} ms"
                f" ({result['private'] / result['shared']:.2f}x)",
                flush=True,
            )
    report["load_average"] = os.getloadavg()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
