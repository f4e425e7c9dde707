"""``prefixcache bench serve-compare``: ``bench serve``'s workload against prefixcache serve, llama.cpp's server and
vLLM's CPU build, each started here on the same model with the same threads, in one run.

The engines run one at a time, each started, measured over the whole sweep and stopped before the next starts, on
the same prompts at the same arrival times. Not side by side: an engine left idle beside the measured one still
slows it (on the 2-core development host, prefixcache's 80% point took a TPOT of 2,194 ms with a second, idle
server bound to the cores beside it, against 67-70 ms alone, 2026-12-02), so what else loads the machine is
written down instead (the load average around each engine's sweep).

- **prefixcache**: ``prefixcache serve`` with the user's defaults (``--dtype auto``: bfloat16 on a CPU with
  bfloat16 instructions), once per ``--quantization`` (``none``: the GGUF dequantized, ``gguf``: its int4/int8
  weights), its engine core on ``--threads`` threads (``OMP_NUM_THREADS``);
- **llama.cpp**: its server on the model's GGUF (``prefixcache.bench.peers.llamacpp_command``) with
  ``--llamacpp-parallel`` slots (its own default: 4) and ``--threads`` threads;
- **vLLM**: ``--vllm-serve`` (the shared peers' ``vllm-cpu/serve.sh``: prefix caching on, 32-token blocks) on the
  converted checkpoint in the same dtype, its OpenMP threads bound to ``--threads`` cores.

Prompts are token ids drawn from the model's tokenizer (its non-special ids), sent as id lists: none of the three
adds a BOS to them (llama.cpp reports the prompt's own length as ``prompt_tokens``; the report checks it).
An engine that is not installed is left out with a note; one that fails to start ends the run with its log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from prefixcache.argtypes import comma_separated, positive_int
from prefixcache.bench.peers import LLAMACPP_SERVE, VLLM_CPU_SERVE, llamacpp_command
from prefixcache.bench.serve import add_workload_arguments
from prefixcache.config import QUANTIZATIONS, resolve_dtype

ENGINES = ("prefixcache", "llama.cpp", "vllm")
# llama.cpp's server picks 4 slots when not told (``-np -1``); the shared peers' serve.py does too.
LLAMACPP_DEFAULT_PARALLEL = 4
SERVER_START_S = 900.0

parse_engines = comma_separated(ENGINES)
parse_quantizations = comma_separated(QUANTIZATIONS)


def prefixcache_label(quantization: str, dtype: str) -> str:
    """``prefixcache bfloat16`` (the GGUF dequantized) or ``prefixcache gguf`` (its own quantized weights)."""
    return f"prefixcache {dtype if quantization == 'none' else quantization}"


def prefixcache_serve_args(model: str | None, quantization: str) -> list[str]:
    """``prefixcache serve`` as a user starts it (default dtype and cache), plus the cache reset the sweep needs."""
    return [
        "serve",
        *([] if model is None else [model]),
        "--quantization",
        quantization,
        "--enable-reset-prefix-cache",
        "--disable-log-stats",
        "--disable-uvicorn-access-log",
    ]


def vllm_command(serve_script: Path, model_dir: Path, port: int, dtype: str) -> list[str]:
    """vLLM's OpenAI server through the shared peers' ``serve.sh MODEL_DIR PORT DTYPE``."""
    return [str(serve_script), str(model_dir), str(port), dtype, "--uvicorn-log-level", "warning"]


def vllm_env(threads: int) -> dict[str, str]:
    """The reset endpoint (dev mode), and OpenMP bound to ``threads`` cores: vLLM's CPU build otherwise keeps one
    core of a small machine for its front end and computes on the rest (one thread of two)."""
    cores = min(threads, os.cpu_count() or 1)
    return {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}"}


def compare_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """At each shared fraction, every prefixcache row against every other engine's: mean TTFT and TPOT as ours
    over theirs (below 1: ours is faster) and output tokens/s as ours over theirs (above 1: ours serves more)."""
    comparisons = []
    fractions = dict.fromkeys(row["shared_fraction"] for row in rows)
    for fraction in fractions:
        at = [row for row in rows if row["shared_fraction"] == fraction and row["completed"]]
        for ours in (row for row in at if row["label"].startswith("prefixcache")):
            for peer in (row for row in at if not row["label"].startswith("prefixcache")):
                comparisons.append(
                    {
                        "shared_fraction": fraction,
                        "ours": ours["label"],
                        "peer": peer["label"],
                        "ttft_ratio": _ratio(ours["mean_ttft_ms"], peer["mean_ttft_ms"]),
                        "tpot_ratio": _ratio(ours["mean_tpot_ms"], peer["mean_tpot_ms"]),
                        "output_throughput_ratio": _ratio(ours["output_throughput"], peer["output_throughput"]),
                    }
                )
    return comparisons


def _ratio(ours: float, theirs: float) -> float | None:
    return round(ours / theirs, 3) if theirs else None


def prompt_length_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Engines whose reported prompt tokens are not the ids sent (a BOS added, or a prompt cut): their rows
    measure other prompts than the rest."""
    notes = []
    for row in rows:
        sent = row["completed"] * row["input_len"]
        if row["completed"] and row["total_input_tokens"] != sent:
            notes.append(
                f"{row['label']} at shared {row['shared_fraction']}: the server counted {row['total_input_tokens']} "
                f"prompt tokens for {sent} ids sent"
            )
    return notes


def format_report(report: dict[str, Any]) -> str:
    """One line per engine and point, the ratios, the load average around each engine's sweep, the notes."""
    settings = report["settings"]
    loads = "; ".join(
        f"{label} {before[0]:.2f} -> {after[0]:.2f}" for label, (before, after) in report["load_average_around"].items()
    )
    lines = [
        f"serve-compare: {settings['num_prompts']} x {settings['input_len']} tokens, {settings['output_len']} out, "
        f"{settings['request_rate']} req/s, {settings['threads']} threads each, one engine at a time; "
        f"load average (1 min) {loads}",
        "",
        "| shared | engine | TTFT mean / p99 ms | TPOT mean / p99 ms | output tok/s | hit rate |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for row in sorted(report["rows"], key=lambda r: r["shared_fraction"]):
        hit_rate = "n/a" if row["hit_rate"] is None else f"{row['hit_rate']:.2f}"
        lines.append(
            f"| {row['shared_fraction']:.0%} | {row['label']} | {row['mean_ttft_ms']:,.0f} / {row['p99_ttft_ms']:,.0f} "
            f"| {row['mean_tpot_ms']:,.0f} / {row['p99_tpot_ms']:,.0f} | {row['output_throughput']:.1f} | {hit_rate} |"
        )
    lines.append("")
    for c in report["comparisons"]:
        lines.append(
            f"shared {c['shared_fraction']:.0%}: {c['ours']} / {c['peer']}: TTFT {c['ttft_ratio']}x, "
            f"TPOT {c['tpot_ratio']}x, output tok/s {c['output_throughput_ratio']}x"
        )
    lines += [f"note: {note}" for note in report["notes"]]
    return "\n".join(lines)


def server_launchers(
    args: argparse.Namespace, model_dir: Path, logs: Path
) -> tuple[dict[str, Callable[[], Any]], list[str]]:
    """The servers to compare (label: what starts its process), and a note for each engine left out.

    Each is started only when its turn comes, and stopped before the next starts: an engine starting up or idle
    beside the measured one takes its cores (vLLM's start-up beside prefixcache's bfloat16 server cut that
    server's output tok/s from 340 to 66-92 here), and one never started cannot be left behind by a failed run."""
    from prefixcache.bench.live import ExternalProcess, Process, free_port
    from prefixcache.model.loader import gguf_source

    dtype, _ = resolve_dtype("auto", "cpu")
    threads = {"OMP_NUM_THREADS": str(args.threads)}
    servers: dict[str, Any] = {}
    notes = []
    for engine in args.engines:
        if engine == "prefixcache":
            for quantization in args.quantization:
                servers[prefixcache_label(quantization, dtype)] = partial(
                    Process,
                    prefixcache_serve_args(args.model, quantization),
                    logs / f"prefixcache-{quantization}.log",
                    threads,
                )
        elif engine == "llama.cpp":
            try:
                gguf = gguf_source(args.model)
            except ValueError:
                notes.append("llama.cpp left out: the model is not a GGUF")
                continue
            port = free_port()
            command = llamacpp_command(gguf, port, args.threads, args.llamacpp_serve, args.llamacpp_parallel)
            if command is None:
                notes.append(f"llama.cpp left out: not installed (the xllamacpp peer and {args.llamacpp_serve})")
                continue
            label = f"llama.cpp ({args.llamacpp_parallel} slots)"
            servers[label] = partial(ExternalProcess, command, port, logs / "llamacpp.log", threads)
        elif not args.vllm_serve.is_file():
            notes.append(f"vLLM left out: no {args.vllm_serve}")
        else:
            port = free_port()
            command = vllm_command(args.vllm_serve, model_dir, port, dtype)
            servers["vLLM CPU"] = partial(ExternalProcess, command, port, logs / "vllm.log", vllm_env(args.threads))
    return servers, notes


def run(args: argparse.Namespace) -> dict[str, Any]:
    from prefixcache.bench.live import running, served_model
    from prefixcache.bench.serve import benchmark_server, plot

    model_dir, name, _ = served_model(args.model)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="bench-serve-compare-"))
    logs.mkdir(parents=True, exist_ok=True)
    servers, notes = server_launchers(args, model_dir, logs)
    if not servers:
        raise SystemExit("no engine to run: " + "; ".join(notes))
    # the sweep's own options; prompts from the model's tokenizer, each server's own model name
    sweep_args = argparse.Namespace(**vars(args) | {"model": None, "tokenizer": str(model_dir), "vocab_size": None})
    rows: list[dict[str, Any]] = []
    load_around: dict[str, list[list[float]]] = {}
    for label, launch in servers.items():
        with running([server := launch()], SERVER_START_S):
            before = list(os.getloadavg())
            rows += asyncio.run(benchmark_server(sweep_args, label, server.url, {}))
            load_around[label] = [before, list(os.getloadavg())]
    settings = {
        "model": name,
        "engines": list(servers),
        "threads": args.threads,
        "llamacpp_parallel": args.llamacpp_parallel,
        **{key: rows[0][key] for key in ("num_prompts", "input_len", "output_len", "request_rate", "rounds")},
        "logs": str(logs),
    }
    report = {
        "settings": settings,
        "load_average_around": load_around,
        "rows": rows,
        "comparisons": compare_rows(rows),
        "notes": notes + prompt_length_notes(rows),
    }
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot is not None:
        plot(rows, args.plot)
    return report


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "serve-compare",
        help="bench serve's sweep against prefixcache serve, llama.cpp's server and vLLM CPU, one engine at a time",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", default=None, help="HF checkpoint dir or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--engines",
        type=parse_engines,
        default=list(ENGINES),
        help=f"comma-separated, of {', '.join(ENGINES)}; those not installed are left out with a note",
    )
    p.add_argument(
        "--quantization",
        type=parse_quantizations,
        default=["none"],
        help=f"comma-separated prefixcache servers to start (of {', '.join(QUANTIZATIONS)})",
    )
    p.add_argument("--threads", type=positive_int, default=2, help="compute threads of every engine")
    p.add_argument(
        "--llamacpp-parallel", type=positive_int, default=LLAMACPP_DEFAULT_PARALLEL, help="llama.cpp's slots (-np)"
    )
    p.add_argument("--llamacpp-serve", type=Path, default=LLAMACPP_SERVE, help="llama.cpp's serve.py (shared peers)")
    p.add_argument("--vllm-serve", type=Path, default=VLLM_CPU_SERVE, help="vLLM's serve.sh MODEL_DIR PORT DTYPE")
    add_workload_arguments(p)
    p.add_argument("--logs", type=Path, default=None, help="keep the servers' logs here (default: a temporary dir)")
    p.add_argument("--json", type=Path, default=None, help="write the report (settings, rows, ratios) here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of TTFT and TPOT against the shared fraction")
    p.set_defaults(func=run)
