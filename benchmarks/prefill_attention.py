"""A prefill step's attention, SmolLM2-135M's shape (9 query heads, 3 KV heads of 64, blocks of 16):
prefixcache's native kernel (``paged_prefill_attention``, K/V read in place) against torch's path (the blocks
gathered, a padded and masked SDPA), measured alternately in one process, at 1 and 2 threads, bfloat16 and
float32. Requests of ``--prompt`` tokens of which ``--cached`` (0, and the shared prefix) are already in the
cache; batches of 1 and ``--batch``. ``layer``: one attention layer (the K/V write included); ``--model``: also
the whole step of a random SmolLM2-135M-shaped model (30 layers) for one request, what the kernel changes of a
prefill. Times are medians per call by the wall clock and by the process's CPU time (at one thread the
steadier on a busy machine); write ``uptime``'s load beside them.

    PYTHONPATH=src .venv/bin/python benchmarks/prefill_attention.py [--prompt 500] [--cached 400] [--batch 16]
        [--model]
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
from prefixcache.model import DecoderForCausalLM, ModelConfig, attention
from prefixcache.model.attention import AttentionMetadata, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
PATHS = ("kernel", "torch")


SMOLLM2_135M = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    num_layers=30,
    num_heads=HEADS,
    num_kv_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    intermediate_size=1536,
    rms_norm_eps=1e-5,
    rope_theta=1e5,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def step_metadata(batch: int, prompt: int, cached: int, kernel: bool) -> AttentionMetadata:
    """A step of ``batch`` requests, each ``prompt - cached`` new tokens after ``cached`` in the cache (their
    own blocks), on the kernel's path or torch's."""
    blocks = -(-prompt // BLOCK_SIZE)
    tables = [list(range(r * blocks, (r + 1) * blocks)) for r in range(batch)]
    new = prompt - cached
    with mock.patch.object(attention, "_prefill_kernel", attention._prefill_kernel if kernel else lambda: None):
        return AttentionMetadata.build(tables, [cached] * batch, [new] * batch, BLOCK_SIZE, "cpu")


def make_model_case(model: DecoderForCausalLM, batch: int, prompt: int, cached: int, kernel: bool):
    """The whole forward of that step (the model's dtype)."""
    metadata = step_metadata(batch, prompt, cached, kernel)
    blocks = -(-prompt // BLOCK_SIZE)
    kv_caches = model.allocate_kv_cache(batch * blocks, BLOCK_SIZE)
    ids = torch.randint(0, SMOLLM2_135M.vocab_size, (metadata.num_tokens,))
    return lambda: model(ids, metadata.positions, kv_caches, [metadata])


def make_case(batch: int, prompt: int, cached: int, dtype: torch.dtype, kernel: bool):
    """The call that runs one layer's attention of that step."""
    blocks = -(-prompt // BLOCK_SIZE)
    shape = (batch * blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    new = prompt - cached
    metadata = step_metadata(batch, prompt, cached, kernel)
    query = torch.randn(batch * new, HEADS, HEAD_DIM).to(dtype)
    key, value = torch.randn(2, batch * new, KV_HEADS, HEAD_DIM).to(dtype)
    workspace = attention.GatherWorkspace()
    scale = HEAD_DIM**-0.5
    return lambda: paged_attention(query, key, value, k_cache, v_cache, metadata, scale, None, workspace)


def median_ms(runs: dict[str, object], repeats: int) -> dict[str, tuple[float, float]]:
    """Median milliseconds of each run, by the wall clock and by this process's CPU time (all its threads: on a
    loaded machine the time the run was descheduled does not count), the runs taking turns."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for run in runs.values():
        run()  # warm up: buffers, the kernel's first call
    for _ in range(repeats):
        for name, run in runs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {
        name: (statistics.median(w for w, _ in t) * 1e3, statistics.median(c for _, c in t) * 1e3)
        for name, t in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=positive_int, default=500)
    parser.add_argument("--cached", type=int, default=400)
    parser.add_argument("--batch", type=positive_int, default=16)
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--model", action="store_true", help="also the whole step of a SmolLM2-135M-shaped model")
    args = parser.parse_args()
    if attention._prefill_kernel() is None:
        raise SystemExit("prefixcache's CPU kernels are unavailable here: nothing to compare")
    print(f"load average: {os.getloadavg()}")
    torch.manual_seed(0)
    models = {}
    if args.model:
        base = DecoderForCausalLM(SMOLLM2_135M).requires_grad_(False).eval()
        models = {torch.bfloat16: base.to(torch.bfloat16), torch.float32: DecoderForCausalLM(SMOLLM2_135M).eval()}
        models[torch.float32].requires_grad_(False)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for dtype in (torch.bfloat16, torch.float32):
            for batch in (1, args.batch):
                for cached in (0, args.cached):
                    cases = {"layer": {p: make_case(batch, args.prompt, cached, dtype, p == "kernel") for p in PATHS}}
                    if dtype in models and batch == 1:  # a batch's whole step takes tens of seconds here
                        model = models[dtype]
                        cases["model"] = {
                            p: make_model_case(model, batch, args.prompt, cached, p == "kernel") for p in PATHS
                        }
                    for what, runs in cases.items():
                        with torch.inference_mode():
                            ms = median_ms(runs, args.repeats if what == "layer" else max(args.repeats // 2, 1))
                        row = {
                            "what": what,
                            "threads": threads,
                            "dtype": str(dtype).removeprefix("torch."),
                            "batch": batch,
                            "cached": cached,
                            "kernel_wall_ms": round(ms["kernel"][0], 2),
                            "torch_wall_ms": round(ms["torch"][0], 2),
                            "kernel_cpu_ms": round(ms["kernel"][1], 2),
                            "torch_cpu_ms": round(ms["torch"][1], 2),
                            "speedup_wall": round(ms["torch"][0] / ms["kernel"][0], 2),
                            "speedup_cpu": round(ms["torch"][1] / ms["kernel"][1], 2),
                        }
                        print(json.dumps(row), flush=True)
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()
