"""Decode ms/step by torch threads and OpenMP wait policy, each setting in a fresh process.

libgomp reads ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` once, when it initializes (as torch is imported), so
each setting runs ``prefixcache bench decode --no-stream`` in its own subprocess; settings alternate within a
round and rounds repeat, so a setting's median over its rounds is compared with the others' measured minutes
apart on the same (shared, loaded) machine. Each subprocess reports every round of every point
(``rounds_ms``); the table gives the median of all of them and the load average beside it.

    PYTHONPATH=src python benchmarks/omp_wait.py --repeats 2 --json results/omp_wait.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (label, torch threads, environment on top of the caller's, OpenMP's own variables removed first)
SETTINGS = {
    "1t": (1, {}),
    "2t-default": (2, {}),
    "2t-ACTIVE": (2, {"OMP_WAIT_POLICY": "ACTIVE"}),
    "2t-PASSIVE": (2, {"OMP_WAIT_POLICY": "PASSIVE"}),
    "2t-spin3k": (2, {"GOMP_SPINCOUNT": "3000"}),
    "2t-spin30k": (2, {"GOMP_SPINCOUNT": "30000"}),
    "2t-spin3M": (2, {"GOMP_SPINCOUNT": "3000000"}),
    # the compiled step only: inductor's C++ wrapper (no Python between kernels), and kernels kept on one thread
    # up to 32k elements a thread (inductor parallelizes from 512, torch's eager ops from 32k)
    "1t-cppwrap": (1, {"TORCHINDUCTOR_CPP_WRAPPER": "1"}),
    "2t-cppwrap": (2, {"TORCHINDUCTOR_CPP_WRAPPER": "1"}),
    "2t-chunk32k": (2, {"TORCHINDUCTOR_CPP_MIN_CHUNK_SIZE": "32768"}),
}
OMP_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def run_setting(label: str, args: argparse.Namespace, work: Path) -> tuple[dict, float]:
    threads, extra = SETTINGS[label]
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARIABLES} | extra
    out = work / f"{label}-{time.monotonic_ns()}.json"
    command = [sys.executable, "-m", "prefixcache.cli", "bench", "decode", "--no-stream", "--threads", str(threads)]
    command += ["--batch-sizes", args.batch_sizes, "--modes", args.modes, "--quantization", args.quantization]
    command += ["--rounds", str(args.rounds), "--output-len", str(args.output_len), "--json", str(out)]
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text()), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated labels of SETTINGS")
    parser.add_argument("--repeats", type=int, default=2, help="rounds over all settings")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds inside each subprocess")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--quantization", default="none,gguf")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    labels = args.settings.split(",")
    samples: dict[tuple[str, str, int], list[float]] = {}
    loads: list[list[float]] = []
    with tempfile.TemporaryDirectory(prefix="omp-wait-") as work:
        for repeat in range(args.repeats):
            order = labels if repeat % 2 == 0 else labels[::-1]
            for label in order:
                report, seconds = run_setting(label, args, Path(work))
                loads.append(report["load_average"])
                print(f"[{repeat}] {label}: {seconds:.0f} s, load {report['load_average'][0]:.2f}", flush=True)
                for row in report["offline"]:
                    samples.setdefault((row["engine"], label, row["batch"]), []).extend(row["rounds_ms"])
                print(format_table(samples, labels, loads, args), flush=True)
                if args.json is not None:  # after every setting: a run cut short keeps what it measured
                    rows = [{"engine": e, "setting": s, "batch": b, "rounds_ms": v} for (e, s, b), v in samples.items()]
                    args.json.write_text(json.dumps({"loads": loads, "rows": rows}, indent=2) + "\n")


def format_table(
    samples: dict[tuple[str, str, int], list[float]],
    labels: list[str],
    loads: list[list[float]],
    args: argparse.Namespace,
) -> str:
    """One row per engine and batch, one column per setting (median ms/step), and the 1 -> 2 thread speedup."""
    engines = list(dict.fromkeys(engine for engine, _, _ in samples))
    batches = sorted({batch for _, _, batch in samples})
    medians = {key: statistics.median(values) for key, values in samples.items()}
    lines = [
        f"median ms/step over {args.repeats} x {args.rounds} rounds; load average (1 min) during the run "
        f"{min(x[0] for x in loads):.2f}-{max(x[0] for x in loads):.2f}",
        "",
        "| engine | batch | " + " | ".join(labels) + " | 1 -> 2 threads (default) |",
        "|---|---:|" + "---:|" * len(labels) + "---:|",
    ]
    for engine in engines:
        for batch in batches:
            cells = [
                f"{medians[(engine, label, batch)]:.2f}" if (engine, label, batch) in medians else "–"
                for label in labels
            ]
            speedup = ""
            if (engine, "1t", batch) in medians and (engine, "2t-default", batch) in medians:
                speedup = f"{medians[(engine, '1t', batch)] / medians[(engine, '2t-default', batch)]:.2f}x"
            lines.append(f"| {engine} | {batch} | " + " | ".join(cells) + f" | {speedup} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
