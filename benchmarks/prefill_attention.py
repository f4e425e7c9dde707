"""One attention layer of a prefill step, SmolLM2-135M's shape (9 query heads, 3 KV heads of 64, blocks of 16):
prefixcache's native kernel (``paged_prefill_attention``, K/V read in place) against torch's path (the blocks
gathered, a padded and masked SDPA), measured alternately in one process, at 1 and 2 threads, bfloat16 and
float32. Requests of ``--prompt`` tokens of which ``--cached`` (0, and the shared prefix) are already in the
cache; batches of 1 and ``--batch``. Times are the wall clock's median per call (the K/V write included), so
a busy machine shows: write ``uptime``'s load beside them.

    PYTHONPATH=src .venv/bin/python benchmarks/prefill_attention.py [--prompt 500] [--cached 400] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from unittest import mock

import torch

from prefixcache.argtypes import positive_int
from prefixcache.model import attention
from prefixcache.model.attention import AttentionMetadata, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def make_case(batch: int, prompt: int, cached: int, dtype: torch.dtype, kernel: bool):
    """A step of ``batch`` requests, each ``prompt - cached`` new tokens after ``cached`` in the cache (their
    own blocks), and the call that runs its attention."""
    blocks = -(-prompt // BLOCK_SIZE)
    tables = [list(range(r * blocks, (r + 1) * blocks)) for r in range(batch)]
    shape = (batch * blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    new = prompt - cached
    with mock.patch.object(attention, "_prefill_kernel", attention._prefill_kernel if kernel else lambda: None):
        metadata = AttentionMetadata.build(tables, [cached] * batch, [new] * batch, BLOCK_SIZE, "cpu")
    query = torch.randn(batch * new, HEADS, HEAD_DIM).to(dtype)
    key, value = torch.randn(2, batch * new, KV_HEADS, HEAD_DIM).to(dtype)
    workspace = attention.GatherWorkspace()
    scale = HEAD_DIM**-0.5
    return lambda: paged_attention(query, key, value, k_cache, v_cache, metadata, scale, None, workspace)


def median_ms(runs: dict[str, object], repeats: int) -> dict[str, float]:
    """Median wall milliseconds of each run, the runs taking turns (so load slows them alike)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()  # warm up: buffers, the kernel's first call
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=positive_int, default=500)
    parser.add_argument("--cached", type=int, default=400)
    parser.add_argument("--batch", type=positive_int, default=16)
    parser.add_argument("--repeats", type=positive_int, default=7)
    args = parser.parse_args()
    if attention._prefill_kernel() is None:
        raise SystemExit("prefixcache's CPU kernels are unavailable here: nothing to compare")
    print(f"load average: {os.getloadavg()}")
    report = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for dtype in (torch.bfloat16, torch.float32):
            for batch in (1, args.batch):
                for cached in (0, args.cached):
                    runs = {
                        path: make_case(batch, args.prompt, cached, dtype, path == "kernel")
                        for path in ("kernel", "torch")
                    }
                    ms = median_ms(runs, args.repeats)
                    row = {
                        "threads": threads,
                        "dtype": str(dtype).removeprefix("torch."),
                        "batch": batch,
                        "cached": cached,
                        "kernel_ms": round(ms["kernel"], 3),
                        "torch_ms": round(ms["torch"], 3),
                        "speedup": round(ms["torch"] / ms["kernel"], 2),
                    }
                    report.append(row)
                    print(json.dumps(row), flush=True)
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()
