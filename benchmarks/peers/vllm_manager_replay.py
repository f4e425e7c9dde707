"""Replay a ``prefixcache bench manager`` trace through vLLM's own v1 KVCacheManager.

Run with vLLM's interpreter (``/tmp/vllm-cpu-venv/bin/python``), not ours: vLLM is never a dependency
of the package. ``prefixcache bench manager --compare-vllm`` writes the trace as JSON, runs this script
and reads the one JSON object on the last line of stdout (vLLM may log above it).

The replay mirrors ``prefixcache.bench.manager.replay`` step for step, so the per-phase numbers line up:
requests are built before the clock starts, then per request hashing (vLLM's own request block hasher
with ``prefix_caching_hash_algo``'s function and NONE_HASH initialised the way ``EngineCore`` does),
lookup (``get_computed_blocks``), allocation of the whole prompt (``allocate_slots``, plus the
admission-time ``record_prefix_cache_stats`` the scheduler makes, as ours counts stats on admission),
and free of the oldest request once more than ``max_live`` are live. As ``EngineCore`` does, the
startup heap is frozen out of the garbage collector before the replays.

Usage: vllm_manager_replay.py TRACE.json
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import vllm
from vllm import SamplingParams
from vllm.utils.gc_utils import freeze_gc_heap
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

MAX_MODEL_LEN = 8192


def make_manager(num_blocks: int, block_size: int) -> KVCacheManager:
    """One full-attention group; the manager never touches tensors, so the spec's shape is nominal."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float16)
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=spec)],
    )
    return KVCacheManager(
        kv_cache_config=config,
        max_model_len=MAX_MODEL_LEN,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=True,
        log_stats=True,
    )


def replay(prompts: list[list[int]], num_blocks: int, block_size: int, max_live: int, hash_algo: str) -> dict:
    """Replay the trace once; per-request phase means and percentiles in microseconds."""
    hash_fn = get_hash_fn_by_name(hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(block_size, hash_fn)
    manager = make_manager(num_blocks, block_size)
    # No block_hasher here: Request.__init__ would hash eagerly, outside the hashing phase's clock.
    requests = [
        Request(
            request_id=str(i),
            prompt_token_ids=p,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
        )
        for i, p in enumerate(prompts)
    ]
    clock = time.perf_counter_ns
    phases = np.zeros((len(requests), 4), dtype=np.int64)
    num_hit_tokens = 0
    live: list[Request] = []
    for i, request in enumerate(requests):
        t0 = clock()
        request.block_hashes.extend(hasher(request))  # what Request.update_block_hashes does
        t1 = clock()
        blocks, num_computed, _ = manager.get_computed_blocks(request)
        t2 = clock()
        if manager.allocate_slots(request, request.num_tokens - num_computed, num_computed, blocks) is None:
            raise RuntimeError("the trace does not fit the pool; raise num_blocks")
        manager.record_prefix_cache_stats(request, num_computed)
        t3 = clock()
        live.append(request)
        if len(live) > max_live:
            manager.free(live.pop(0))
        t4 = clock()
        phases[i] = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
        num_hit_tokens += num_computed
    for request in live:
        manager.free(request)
    stats = manager.make_prefix_cache_stats()
    num_prompt_tokens = sum(len(p) for p in prompts)
    if stats is not None and (stats.hits, stats.queries) != (num_hit_tokens, num_prompt_tokens):
        raise RuntimeError(f"vLLM's stats {stats.hits}/{stats.queries} disagree with the replay's count")
    per_request = phases.sum(axis=1) / 1e3
    means = phases.mean(axis=0) / 1e3
    num_hashed = sum(len(p) // block_size * block_size for p in prompts)
    return {
        "hashing_us": float(means[0]),
        "lookup_us": float(means[1]),
        "allocate_us": float(means[2]),
        "free_us": float(means[3]),
        "total_us": float(per_request.mean()),
        "p50_us": float(np.percentile(per_request, 50)),
        "p99_us": float(np.percentile(per_request, 99)),
        "hit_rate": num_hit_tokens / num_prompt_tokens,
        "hash_ns_per_token": float(phases[:, 0].sum() / num_hashed),
    }


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit(__doc__)
    # EngineCore freezes its startup heap so full collections skip it; without this, the first replay
    # pays a gen-2 collection over everything torch's import allocated (hundreds of ms).
    freeze_gc_heap()
    trace: dict[str, Any] = json.loads(Path(argv[0]).read_text())
    prompts = trace["prompts"]
    if max(map(len, prompts)) > MAX_MODEL_LEN:
        sys.exit(f"a prompt is longer than max_model_len={MAX_MODEL_LEN}")
    runs = [
        replay(prompts, trace["num_blocks"], trace["block_size"], trace["max_live"], trace["hash_algo"])
        for _ in range(max(1, trace.get("repeats", 1)))
    ]
    gc.unfreeze()  # lets torch/triton tear down quietly at exit (frozen objects leak there)
    best = min(runs, key=lambda r: r["total_us"])
    best["total_us_runs"] = [round(r["total_us"], 1) for r in runs]
    best["vllm_version"] = vllm.__version__
    best["python"] = sys.version.split()[0]
    print(json.dumps(best), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
