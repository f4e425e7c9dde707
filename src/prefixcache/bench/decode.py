"""``prefixcache bench decode``: decode speed against the memory-bandwidth limit and llama.cpp's server.

A decode step reads every weight once (and each request's K/V), so on a CPU its floor is the bytes it reads
over the machine's memory bandwidth. This measures, in one run:

- **offline batches** (``LLM`` in this process): ``--batch-sizes`` requests decoding together, for each
  ``--quantization`` (default ``none`` and ``gguf``) and each of ``--modes`` (``eager``, the default, and
  ``compiled``: ``--no-enforce-eager``, with the seconds its start-up spent compiling), in ms per step and
  output tokens/s; the step's bytes
  (weights, plus the K/V read at the mean context) over the measured bandwidth give the fastest step possible,
  and the fraction of it reached;
- **one stream** through ``prefixcache serve`` (each quantization, its core on ``--threads`` threads) and through
  llama.cpp's server on the same GGUF with the same threads, when the ``xllamacpp`` peer is installed
  (``prefixcache.bench.peers``) and its ``serve.py`` (``../shared/peers/llamacpp``) is there: decode tokens/s a
  streaming client sees, after the first; beside them in the same rounds the same stream offline (``LLM`` in this
  process), so what the server path adds is a ratio of rates measured minutes apart at most, not across phases;
- **the memory bandwidth**: the best of several copies of a tensor larger than the caches (read + write bytes).

Rounds alternate the engines, and each point keeps its best round: the one least disturbed by whatever else
runs on the machine (the report says so, and gives the load average).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefixcache.argtypes import comma_separated, positive_int
from prefixcache.bench.peers import LLAMACPP_SERVE, llamacpp_command
from prefixcache.config import QUANTIZATIONS, EngineConfig
from prefixcache.engine.args import config_default

BANDWIDTH_BYTES = 512 * 2**20
SERVER_START_S = 600.0


@dataclass(slots=True)
class DecodePoint:
    """One engine at one batch size: the best round's decode steps (prefill excluded)."""

    engine: str
    batch: int
    steps: int
    seconds: float
    bytes_per_step: int
    rounds_ms: list[float] = field(default_factory=list)

    @property
    def ms_per_step(self) -> float:
        return self.seconds / self.steps * 1e3

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.steps / self.seconds


@dataclass(slots=True)
class StreamPoint:
    """One server's single stream: decode tokens/s after the first token (best round)."""

    server: str
    tokens_per_s: float
    rounds: list[float] = field(default_factory=list)


def parse_sizes(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]``; ArgumentTypeError for anything but positive integers."""
    try:
        sizes = [positive_int(part.strip()) for part in text.split(",")]
    except (argparse.ArgumentTypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    return sorted(dict.fromkeys(sizes))


MODES = ("eager", "compiled")
parse_quantizations = comma_separated(QUANTIZATIONS)
parse_modes = comma_separated(MODES)


def measure_bandwidth(num_bytes: int = BANDWIDTH_BYTES, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes per second of the best of ``repeats`` tensor copies on ``device`` (each byte read once and written
    once), the memory a decode step's weights are read from."""
    import torch

    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    synchronize = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    best = float("inf")
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def weight_bytes_read(model: Any) -> int:
    """Bytes of weights one decode step reads: the layers', the final norm's and the output projection's, each
    storage once; of an embedding only the looked-up rows (nothing, next to the rest), unless the output projection
    is the embedding's own table (tied)."""
    from torch import nn

    from prefixcache.model.quantization import module_bytes

    head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    return module_bytes(nn.ModuleList([model.model.layers, model.model.norm, head]))


def decode_batch(llm: Any, prompts: Sequence[list[int]], output_len: int) -> tuple[int, float]:
    """Decode ``prompts`` together for ``output_len`` tokens; (steps, seconds) after every prefill finished."""
    from prefixcache.engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    for prompt in prompts:
        engine.add_request(prompt, params)
    produced: set[str] = set()
    while len(produced) < len(prompts):  # prefill (and any first decode steps of early requests)
        produced.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps, time.perf_counter() - start


def run_offline(
    configs: dict[str, EngineConfig],
    batch_sizes: Sequence[int],
    prompt_len: int,
    output_len: int,
    rounds: int,
    compile_s: dict[str, float] | None = None,
) -> list[DecodePoint]:
    """Every engine at every batch size, ``rounds`` times, engines alternating within a round; each compiled
    engine's compile seconds go to ``compile_s``."""
    from prefixcache.engine import LLM
    from prefixcache.engine.core import load_engine_model

    llms = {}
    for label, config in configs.items():
        llms[label] = LLM(config=config, loaded=load_engine_model(config))
        seconds = llms[label].engine.core.decode_compile_s
        if compile_s is not None and seconds is not None:
            compile_s[label] = round(seconds, 1)
    rng = random.Random(0)
    vocab = next(iter(llms.values())).engine.info.vocab_size
    points: dict[tuple[str, int], DecodePoint] = {}
    try:
        for llm in llms.values():  # warm-up: first-call costs (kernel selection, allocations) land here
            decode_batch(llm, [rng.choices(range(2, vocab), k=prompt_len)], 4)
        for _ in range(rounds):
            for batch in batch_sizes:
                prompts = [rng.choices(range(2, vocab), k=prompt_len) for _ in range(batch)]
                for label, llm in llms.items():
                    steps, seconds = decode_batch(llm, prompts, output_len)
                    model = llm.engine.core.loaded.model
                    kv_bytes = llm.engine.core.block_bytes // llm.engine.info.block_size
                    mean_context = prompt_len + (output_len + 1) / 2
                    step_bytes = weight_bytes_read(model) + int(batch * mean_context * kv_bytes)
                    point = points.get((label, batch))
                    if point is None or seconds / steps < point.seconds / point.steps:
                        rounds_ms = [] if point is None else point.rounds_ms
                        point = points[(label, batch)] = DecodePoint(label, batch, steps, seconds, step_bytes)
                        point.rounds_ms = rounds_ms
                    point.rounds_ms.append(round(seconds / steps * 1e3, 3))
    finally:
        for llm in llms.values():
            llm.engine.close()
    return [points[(label, batch)] for label in configs for batch in batch_sizes]


async def _stream_rate(url: str, model: str, prompt: list[int], output_len: int) -> float:
    from prefixcache.bench.serve import Target, send_request, streaming_client

    async with streaming_client(600) as client:
        result = await send_request(client, Target(url, model, {}), prompt, output_len)
    if not result.success or result.output_tokens < 2:
        raise SystemExit(f"the stream from {url} failed: {result.error}")
    return (result.output_tokens - 1) / (result.latency - result.ttft)


def run_streams(
    args: argparse.Namespace, configs: dict[str, EngineConfig], vocab_size: int, gguf: Path | None, work: Path
) -> tuple[list[StreamPoint], str]:
    """One stream through each prefixcache server (a quantization each) and llama.cpp's, and the same stream
    offline (each of ``configs``) in the same rounds; and why llama.cpp is missing from them, if it is.

    Each server's engine core gets ``OMP_NUM_THREADS=--threads`` (torch's default is one thread per core), so the
    server, the offline engine and llama.cpp decode on the same number of threads."""
    from prefixcache.bench.live import ExternalProcess, Process, free_port, running
    from prefixcache.engine import LLM
    from prefixcache.engine.core import load_engine_model

    threads = str(args.threads)
    servers: dict[str, Process] = {}
    for config in configs.values():
        model = [] if args.model is None else [args.model]
        command = ["serve", *model, "--dtype", args.dtype, "--quantization", config.quantization]
        command += ["--kv-cache-memory", "256MiB", "--device", args.device]
        command += ["--enforce-eager" if config.enforce_eager else "--no-enforce-eager"]
        servers[stream_label("serve", config)] = Process(
            command,
            work / f"serve-{config.quantization}-{'eager' if config.enforce_eager else 'compiled'}.log",
            env={"OMP_NUM_THREADS": threads},
        )
    missing = ""
    port = free_port()
    command = None if gguf is None else llamacpp_command(gguf, port, args.threads, args.llamacpp_serve)
    if command is None:
        missing = (
            "llama.cpp: the model is not a GGUF"
            if gguf is None
            else f"llama.cpp: not installed (the xllamacpp peer and {args.llamacpp_serve})"
        )
    else:
        servers["llama.cpp server"] = ExternalProcess(
            command, port, work / "llamacpp.log", env={"OMP_NUM_THREADS": threads}
        )
    rng = random.Random(1)
    offline = {stream_label("offline", config): config for config in configs.values()}
    points = {label: StreamPoint(label, 0.0) for label in [*servers, *offline]}
    llms: dict[str, Any] = {}
    try:
        with running(list(servers.values()), SERVER_START_S):
            for label, config in offline.items():
                llms[label] = LLM(config=config, loaded=load_engine_model(config))
                decode_batch(llms[label], [[5, 6, 7, 8]], 4)  # warm-up
            for server in servers.values():
                asyncio.run(_stream_rate(server.url, _served_model(server.url), [5, 6, 7, 8], 4))
            for _ in range(args.rounds):
                prompt = rng.choices(range(2, vocab_size), k=args.prompt_len)
                rates = {}
                for label, server in servers.items():
                    rates[label] = asyncio.run(
                        _stream_rate(server.url, _served_model(server.url), prompt, args.output_len)
                    )
                for label, llm in llms.items():
                    steps, seconds = decode_batch(llm, [prompt], args.output_len)  # decode after the first token
                    rates[label] = steps / seconds
                for label, rate in rates.items():
                    points[label].rounds.append(round(rate, 2))
                    points[label].tokens_per_s = max(points[label].rounds)
    finally:
        for llm in llms.values():
            llm.engine.close()
    return list(points.values()), missing


def stream_label(where: str, config: EngineConfig) -> str:
    """``prefixcache serve (gguf compiled)``: a stream's engine, by which the report pairs served and offline."""
    return f"prefixcache {where} ({config.quantization}{'' if config.enforce_eager else ' compiled'})"


def _served_model(url: str) -> str:
    import httpx

    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def build_report(
    offline: Sequence[DecodePoint],
    streams: Sequence[StreamPoint],
    bandwidth: float,
    settings: dict[str, Any],
    notes: Sequence[str] = (),
    compile_s: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The JSON report: each point with its bandwidth limit and the fraction of it reached."""
    rows = []
    for point in offline:
        limit_ms = point.bytes_per_step / bandwidth * 1e3
        rows.append(
            asdict(point)
            | {
                "ms_per_step": round(point.ms_per_step, 3),
                "tokens_per_s": round(point.tokens_per_s, 2),
                "limit_ms_per_step": round(limit_ms, 3),
                "bandwidth_fraction": round(limit_ms / point.ms_per_step, 3),
            }
        )
    return {
        "settings": settings,
        "load_average": list(os.getloadavg()),
        "bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "offline": rows,
        "compile_s": dict(compile_s or {}),
        "streams": [asdict(s) for s in streams],
        "notes": list(notes),
    }


def format_report(report: dict[str, Any]) -> str:
    settings = report["settings"]
    lines = [
        f"decode: {settings['model']} ({settings['dtype']}), {settings['threads']} threads, prompts of "
        f"{settings['prompt_len']} tokens, {settings['output_len']} generated; best of {settings['rounds']} "
        f"rounds; load average {' '.join(f'{x:.2f}' for x in report['load_average'])}",
        f"memory bandwidth (tensor copy on {settings['device']}): {report['bandwidth_gb_s']:.1f} GB/s",
        "",
        "| engine | batch | ms / step | tokens/s | MB read / step | bandwidth limit ms | fraction of limit |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["offline"]:
        lines.append(
            f"| {row['engine']} | {row['batch']} | {row['ms_per_step']:.2f} | {row['tokens_per_s']:.1f} | "
            f"{row['bytes_per_step'] / 1e6:.1f} | {row['limit_ms_per_step']:.2f} | {row['bandwidth_fraction']:.2f} |"
        )
    for engine, seconds in report["compile_s"].items():
        lines.append(f"{engine}: the decode step compiled in {seconds:.1f} s at start-up")
    if report["streams"]:
        by_label = {stream["server"]: stream for stream in report["streams"]}
        lines += ["", "| one stream | tokens/s | rounds | served / offline, per round |", "|---|---:|---|---|"]
        for stream in report["streams"]:
            rounds = ", ".join(f"{r:.1f}" for r in stream["rounds"])
            offline = by_label.get(stream["server"].replace("prefixcache serve", "prefixcache offline"))
            paired = "" if offline is None or offline is stream else served_ratios(stream["rounds"], offline["rounds"])
            lines.append(f"| {stream['server']} | {stream['tokens_per_s']:.1f} | {rounds} | {paired} |")
    lines += [f"note: {note}" for note in report["notes"]]
    return "\n".join(lines)


def served_ratios(served: Sequence[float], offline: Sequence[float]) -> str:
    """Each round's served rate over the offline rate of the same round (the two ran one after the other, so
    the load was nearly the same), and their median: what the server path costs a stream."""
    ratios = sorted(s / o for s, o in zip(served, offline, strict=True))
    middle = len(ratios) // 2
    median = ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2
    return f"{', '.join(f'{r:.2f}' for r in ratios)}; median {median:.2f}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from prefixcache.model.loader import gguf_source

    torch.set_num_threads(args.threads)
    configs = {
        f"prefixcache {quantization}{' compiled' if mode == 'compiled' else ''}": EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            quantization=quantization,
            enforce_eager=mode == "eager",
            kv_cache_memory="256MiB",
            max_num_seqs=max(args.batch_sizes),
        )
        for quantization in args.quantization
        for mode in args.modes
    }
    dtype = next(iter(configs.values())).dtype
    compile_s: dict[str, float] = {}
    offline = run_offline(configs, args.batch_sizes, args.prompt_len, args.output_len, args.rounds, compile_s)
    bandwidth = measure_bandwidth(device=args.device)
    streams: list[StreamPoint] = []
    notes = []
    if args.stream:
        from prefixcache.model.loader import read_config, resolve_model

        try:
            gguf: Path | None = gguf_source(args.model)
        except ValueError:
            gguf = None
        vocab_size = read_config(resolve_model(args.model)[0]).vocab_size
        with tempfile.TemporaryDirectory(prefix="bench-decode-") as work:
            streams, missing = run_streams(args, configs, vocab_size, gguf, Path(work))
        if missing:
            notes.append(missing)
    settings = {
        "model": args.model or "SmolLM2-135M-Instruct",
        "dtype": dtype,
        "device": args.device,
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "rounds": args.rounds,
        "batch_sizes": args.batch_sizes,
        "modes": args.modes,
    }
    report = build_report(offline, streams, bandwidth, settings, notes, compile_s)
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("decode", help="decode ms/step and tokens/s vs the memory-bandwidth limit and llama.cpp")
    p.add_argument("--model", default=None, help="HF checkpoint dir or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=config_default("dtype"), help="as prefixcache serve --dtype")
    p.add_argument("--device", default=config_default("device"), help="cpu or cuda")
    p.add_argument(
        "--quantization",
        type=parse_quantizations,
        default=list(QUANTIZATIONS),
        help=f"comma-separated engines to compare (of {', '.join(QUANTIZATIONS)})",
    )
    p.add_argument(
        "--modes",
        type=parse_modes,
        default=["eager"],
        help="comma-separated: eager (--enforce-eager) and/or compiled (--no-enforce-eager)",
    )
    p.add_argument("--batch-sizes", type=parse_sizes, default=[1, 4, 16], help="comma-separated")
    p.add_argument("--prompt-len", type=positive_int, default=64, help="tokens of each random prompt")
    p.add_argument("--output-len", type=positive_int, default=128, help="tokens generated per request")
    p.add_argument("--rounds", type=positive_int, default=3, help="timed rounds; each point keeps its best")
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1, help="torch (and llama.cpp) threads")
    p.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also one stream through prefixcache serve and llama.cpp's server",
    )
    p.add_argument("--llamacpp-serve", type=Path, default=LLAMACPP_SERVE, help="llama.cpp's serve.py (shared peers)")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    p.set_defaults(func=run)
