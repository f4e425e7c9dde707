"""Decode steps of SmolLM2-135M (bfloat16) with ~500-token contexts: prefixcache's paged decode kernel against
torch's gather + masked SDPA, at several batch sizes and thread counts, interleaved round by round in one
process so that a busy machine slows both alike.

Each request has ``--context`` keys, the first ``--shared`` of them in blocks every request shares (a common
prefix, as the saturation workload's 400 of 500), the rest in blocks of its own; K/V hold random values (the
attention's cost does not depend on them). A step is the model's forward over one new token a request plus its
logits (no sampling), as the engine's decode step runs it eagerly. Reported per step: the median wall-clock time
and the median CPU time of this process (on a shared machine the CPU time of one thread is the steadier number;
with two threads it adds both threads' time, so compare the wall clock there).

    PYTHONPATH=src .venv/bin/python benchmarks/decode_attention.py [--batch-sizes 1,8,16,48,64] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from unittest import mock

import torch

from prefixcache.argtypes import positive_int
from prefixcache.bench.decode import parse_sizes
from prefixcache.model import AttentionMetadata, load_model
from prefixcache.model import attention as attention_mod
from prefixcache.model.native import native_ops


def torch_path() -> mock._patch:
    """The decode steps without the kernel: what runs where it cannot be built."""
    return mock.patch.object(attention_mod, "native_ops", lambda: None)


def decode_step(model, kv_caches, batch: int, context: int, shared: int, block_size: int) -> Callable[[], None]:
    """One decode step of ``batch`` requests at position ``context - 1``, their tables as described above."""
    shared_blocks = list(range(1, shared // block_size + 1))
    own = -(-(context - len(shared_blocks) * block_size) // block_size)
    tables = [shared_blocks + [1 + len(shared_blocks) + r * own + i for i in range(own)] for r in range(batch)]
    metadata = AttentionMetadata.build(tables, [context - 1] * batch, [1] * batch, block_size, "cpu")
    ids = torch.randint(0, model.config.vocab_size, (batch,))

    def step() -> None:
        hidden = model(ids, metadata.positions, kv_caches, [metadata])
        model.compute_logits(hidden[metadata.last_token_indices])

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=parse_sizes, default=[1, 8, 16, 48, 64])
    parser.add_argument("--threads", type=parse_sizes, default=[1, 2])
    parser.add_argument("--context", type=positive_int, default=500, help="keys of each request")
    parser.add_argument("--shared", type=int, default=400, help="of them, in blocks all requests share")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--rounds", type=positive_int, default=5, help="rounds of --steps steps a subject")
    parser.add_argument("--steps", type=positive_int, default=5)
    args = parser.parse_args()
    if native_ops() is None:
        raise SystemExit("prefixcache's CPU kernels are unavailable here: nothing to compare")
    model = load_model(dtype="bfloat16").model
    block_size = args.block_size
    num_blocks = 2 + args.shared // block_size + max(args.batch_sizes) * (-(-args.context // block_size))
    kv_caches = model.allocate_kv_cache(num_blocks, block_size)
    for k_cache, v_cache in kv_caches:
        k_cache.normal_()
        v_cache.normal_()
    subjects = {"kernel": nullcontext, "torch": torch_path}
    report: dict = {
        "config": vars(args) | {"model": "SmolLM2-135M-Instruct (bfloat16)"},
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "load_before": os.getloadavg(),
        "ms_per_step": {},
    }
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batch_sizes:
            step = decode_step(model, kv_caches, batch, args.context, args.shared, block_size)
            wall: dict[str, list[float]] = {name: [] for name in subjects}
            cpu: dict[str, list[float]] = {name: [] for name in subjects}
            for context in subjects.values():
                with context():
                    step()  # warm up
            for _ in range(args.rounds):
                for name, context in subjects.items():
                    with context():
                        start, start_cpu = time.perf_counter(), time.process_time()
                        for _ in range(args.steps):
                            step()
                        wall[name].append((time.perf_counter() - start) / args.steps * 1e3)
                        cpu[name].append((time.process_time() - start_cpu) / args.steps * 1e3)
            row = {}
            for clock, times in (("wall", wall), ("cpu", cpu)):
                medians = {name: statistics.median(t) for name, t in times.items()}
                row |= {f"{name} {clock} ms": round(ms, 2) for name, ms in medians.items()}
                row[f"torch / kernel ({clock})"] = round(medians["torch"] / medians["kernel"], 2)
            row["load"] = round(os.getloadavg()[0], 1)
            report["ms_per_step"][f"{threads} threads, batch {batch}"] = row
            print(f"{threads} threads, batch {batch}: {row}", flush=True)
    report["load_after"] = os.getloadavg()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
