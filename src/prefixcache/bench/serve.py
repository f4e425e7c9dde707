"""``prefixcache bench serve``: online latency of any OpenAI-compatible server (prefixcache, vLLM, ...).

Requests arrive as a Poisson process at ``--request-rate``. Each prompt is ``--input-len`` random token
ids whose first ``--prefix-len`` are shared by every request of the run; prompts go to /v1/completions
as token-id lists so their lengths are exact, and ``ignore_eos`` fixes the output at ``--output-len``.
Every request streams, which gives TTFT, TPOT ((e2e - TTFT) / (output tokens - 1)) and ITL; the hit rate
is the server's own (sum of ``cached_tokens`` / sum of prompt tokens in the usage chunks).

``--sweep-shared-fractions`` runs one point per shared fraction of the input, like the upstream
prefix-caching table, each with a fresh prefix and (where the server allows it) a cache reset first.
Result keys follow vLLM's benchmark, so ``--plot`` can draw runs of both side by side.

So that the sweep cannot flatter the cache: a warm-up request runs first; ``--rounds`` repeats the sweep
in alternating order (forward, then backward, ...), so no point always runs first or last, and a point's
numbers are over all its rounds; and against the unshared point (fraction 0), a point whose mean TTFT fell
by more than its prefill ceiling ``1/(1 - hit_rate)`` is reported as a measurement error (the unshared
point queued, so the ratio measures queueing, not the cache).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixcache.argtypes import positive_int

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)

DEFAULT_SWEEP = "0,0.2,0.4,0.6,0.8"


@dataclass(slots=True)
class RequestResult:
    """One streamed request as the client saw it; times in seconds."""

    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # None: the server reported no prompt_tokens_details
    output_token_ids: list[int] = field(default_factory=list)  # only when asked for (``send_request``)


@dataclass(frozen=True, slots=True)
class Target:
    base_url: str
    model: str
    headers: dict[str, str]


def make_prompts(
    rng: random.Random, token_ids: Sequence[int], num_prompts: int, input_len: int, prefix_len: int
) -> list[list[int]]:
    """``num_prompts`` prompts of ``input_len`` ids: one shared random prefix, then each its own suffix."""
    prefix = rng.choices(token_ids, k=prefix_len)
    return [prefix + rng.choices(token_ids, k=input_len - prefix_len) for _ in range(num_prompts)]


Messages = list[dict[str, Any]]


def streaming_client(timeout: float) -> httpx.AsyncClient:
    """An httpx client whose requests go over aiohttp (``httpx_aiohttp``'s transport), for the benchmarks' streams,
    with no limit on its connections (a sweep point sends all its requests at once), a connection a request.

    The client runs on the machine it measures: every CPU millisecond it spends on a streamed token is taken from
    the server's cores, and on 2 cores that stretches the server's decode step. httpx's own transport parses each
    SSE chunk in Python (h11, anyio); aiohttp's parser is C. One stream of SmolLM2 from ``prefixcache serve``
    (2026-12-06, an Intel host, 2 cores, 4 alternating rounds of 256 tokens): the client's CPU 0.32-0.40 ms a token
    through httpx's transport against 0.24-0.27 through aiohttp's; ``bench decode``'s served over offline, two
    runs each in alternation, 0.88-0.89 against 0.90-0.91. vLLM's serving benchmark streams over aiohttp too.
    """
    import aiohttp
    import httpx
    from httpx_aiohttp import AiohttpTransport

    def session() -> aiohttp.ClientSession:  # made in the running event loop, as aiohttp needs
        # A connection a request: aiohttp does not retry a request on a kept-alive connection the server has closed
        # meanwhile (llama.cpp's server after a stream), as httpx's pool does; a loopback connect is ~0.1 ms.
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))

    return httpx.AsyncClient(timeout=httpx.Timeout(timeout), transport=AiohttpTransport(client=session))


async def send_request(
    client: httpx.AsyncClient,
    target: Target,
    prompt: list[int] | str | Messages,
    output_len: int,
    output_ids: bool = False,
) -> RequestResult:
    """Stream one completion; a token is a chunk with choices, the usage chunk gives the server's counts.

    A prompt of chat messages (dicts) goes to /v1/chat/completions, whose first delta carries the first token's
    text too, so TTFT means the same on both endpoints. ``output_ids`` also collects the generated token ids (from
    completion log-probabilities named ``token_id:<id>``, vLLM's extension), for a follow-up prompt that must
    continue exactly what the server computed."""
    chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
    if chat and output_ids:
        raise ValueError("output_ids needs a completion prompt, not chat messages")
    payload: dict[str, Any] = {
        "model": target.model,
        "messages" if chat else "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if output_ids:
        payload |= {"logprobs": 0, "return_tokens_as_token_ids": True}
    # The usage chunk has the real count; a token-id prompt's length stands in where a server sends none.
    result = RequestResult(prompt_tokens=len(prompt) if isinstance(prompt, list) and not chat else 0)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{target.base_url}{path}", json=payload, headers=target.headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')}"
                return result
            async for line in response.aiter_lines():
                data = line.removeprefix("data:").strip()
                if not line.startswith("data:") or not data:
                    continue
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                if choices := chunk.get("choices"):
                    if output_ids:
                        tokens = (choices[0].get("logprobs") or {}).get("tokens") or []
                        result.output_token_ids += [int(t.removeprefix("token_id:")) for t in tokens]
                    now = time.perf_counter()
                    if result.output_tokens == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.output_tokens += 1
                if usage := chunk.get("usage"):
                    result.output_tokens = usage.get("completion_tokens", result.output_tokens)
                    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens")
    except Exception as exc:  # a failed request is counted, not fatal to the run
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.success = result.output_tokens > 0
    if not result.success:
        result.error = "the stream ended without a token"
    return result


async def run_point(
    client: httpx.AsyncClient,
    target: Target,
    prompts: Sequence[list[int] | Messages],
    output_len: int,
    request_rate: float,
    max_concurrency: int | None,
    rng: random.Random,
    progress: bool,
) -> tuple[list[RequestResult], float]:
    """Send ``prompts`` with Poisson arrivals; returns the results and the wall time of the whole run."""
    from tqdm import tqdm

    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=not progress)

    async def one(prompt: list[int] | Messages) -> RequestResult:
        if limit is None:
            result = await send_request(client, target, prompt, output_len)
        else:
            async with limit:
                result = await send_request(client, target, prompt, output_len)
        bar.update(1)
        return result

    start = time.perf_counter()
    tasks = []
    for i, prompt in enumerate(prompts):
        if i and math.isfinite(request_rate):
            await asyncio.sleep(rng.expovariate(request_rate))
        tasks.append(asyncio.create_task(one(prompt)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return results, duration


def summarize(results: list[RequestResult], duration: float, percentiles: Sequence[int] = (99,)) -> dict[str, Any]:
    """vLLM's result keys (ms, mean/median/p99 or the given percentiles) plus the server-reported hit rate."""
    import numpy as np

    done = [r for r in results if r.success]
    ttfts = [r.ttft for r in done]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itls = [t for r in done for t in r.itl]
    e2es = [r.latency for r in done]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    reported = [r for r in done if r.cached_tokens is not None]
    prompt_reported = sum(r.prompt_tokens for r in reported)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "hit_rate": sum(r.cached_tokens for r in reported) / prompt_reported if prompt_reported else None,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2es)):
        ms = np.asarray(values, dtype=float) * 1000 if values else np.zeros(1)
        summary[f"mean_{name}_ms"] = float(ms.mean())
        summary[f"median_{name}_ms"] = float(np.median(ms))
        for p in percentiles:
            summary[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    summary["errors"] = sorted({r.error for r in results if r.error})[:5]
    return summary


def sweep_order(num_points: int, rounds: int) -> list[tuple[int, int]]:
    """(round, point) in the order they run: the points forward, then backward, alternating."""
    forward = list(range(num_points))
    return [(r, p) for r in range(rounds) for p in (forward if r % 2 == 0 else forward[::-1])]


def check_ceilings(rows: list[dict[str, Any]]) -> None:
    """Against the unshared point, each shared point's mean TTFT speedup and its ceiling ``1/(1 - hit_rate)``
    (prefill is all a cache saves); a speedup above it is marked a measurement error. Rows gain
    ``ttft_speedup``, ``ttft_ceiling`` and ``measurement_error`` (None where nothing compares)."""
    reference = next((r for r in rows if r["shared_fraction"] == 0 and r["completed"]), None)
    for row in rows:
        row["ttft_speedup"] = row["ttft_ceiling"] = row["measurement_error"] = None
        if reference is None or row is reference or not row["completed"] or row["hit_rate"] is None:
            continue
        speedup = reference["mean_ttft_ms"] / row["mean_ttft_ms"] if row["mean_ttft_ms"] else math.inf
        ceiling = 1 / (1 - row["hit_rate"]) if row["hit_rate"] < 1 else math.inf
        row.update(ttft_speedup=speedup, ttft_ceiling=ceiling, measurement_error=speedup > ceiling)


def print_summary(summary: dict[str, Any]) -> None:
    hit_rate = summary["hit_rate"]
    print(
        f"{summary['label']} | shared {summary['shared_fraction']:.2f} | {summary['completed']} ok, "
        f"{summary['failed']} failed in {summary['duration']:.2f}s | TTFT mean {summary['mean_ttft_ms']:.1f} / median "
        f"{summary['median_ttft_ms']:.1f} / p99 {summary['p99_ttft_ms']:.1f} ms | TPOT mean "
        f"{summary['mean_tpot_ms']:.1f} / p99 {summary['p99_tpot_ms']:.1f} ms | ITL mean {summary['mean_itl_ms']:.1f} "
        f"/ p99 {summary['p99_itl_ms']:.1f} ms | {summary['request_throughput']:.2f} req/s, "
        f"{summary['output_throughput']:.1f} out tok/s, {summary['total_token_throughput']:.1f} tok/s | hit rate "
        + ("n/a" if hit_rate is None else f"{hit_rate:.3f}")
    )
    if summary.get("rounds", 1) > 1:
        rounds = ", ".join(f"{ms:.1f}" for ms in summary["mean_ttft_ms_by_round"])
        print(f"  mean TTFT by round (ms, alternating order): {rounds}")
    if summary.get("ttft_speedup") is not None:
        speedup, ceiling = summary["ttft_speedup"], summary["ttft_ceiling"]
        if summary["measurement_error"]:
            print(
                f"  MEASUREMENT ERROR: TTFT {speedup:.2f}x lower than unshared, above its prefill ceiling "
                f"{ceiling:.2f}x (1/(1 - hit rate)), which no cache can give: the unshared point queued (requests "
                "waited for earlier ones), so this ratio measures queueing, not the cache; lower --request-rate"
            )
        else:
            print(f"  TTFT {speedup:.2f}x lower than unshared; prefill ceiling {ceiling:.2f}x")
    for error in summary["errors"]:
        print(f"  error: {error}")


async def discover(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> dict[str, Any]:
    """The first model the server lists (its name, and the vocab size where the server tells it)."""
    response = await client.get(f"{base_url}/v1/models", headers=headers)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise SystemExit(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]


def token_vocabulary(args: argparse.Namespace, model_card: dict[str, Any]) -> list[int]:
    """Token ids to draw prompts from: a tokenizer's non-special ids, else ``range(vocab_size)``."""
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        special = set(tokenizer.all_special_ids)
        return sorted(i for i in tokenizer.get_vocab().values() if i not in special)
    vocab_size = args.vocab_size or model_card.get("vocab_size")
    if not vocab_size:
        raise SystemExit("the server does not report its vocab size; pass --tokenizer or --vocab-size")
    return list(range(vocab_size))


async def reset_prefix_cache(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> bool | None:
    """Drop the server's prefix cache: True if done, False if refused, None where the server offers no reset
    (vLLM outside its dev mode, or prefixcache without --enable-reset-prefix-cache)."""
    response = await client.post(f"{base_url}/reset_prefix_cache", headers=headers)
    if response.status_code in (404, 405):
        return None
    if response.status_code != 200:
        logger.warning("cache reset failed: HTTP %d %s", response.status_code, response.text[:200])
        return False
    try:
        done = response.json().get("success", True)
    except ValueError:  # vLLM answers an empty 200
        done = True
    if not done:
        logger.warning("the server refused to reset its prefix cache (blocks still in use)")
    return done


def shared_fractions(args: argparse.Namespace) -> list[float]:
    """The points to run: ``--sweep-shared-fractions``, else the one fraction ``--prefix-len`` makes."""
    if not 0 <= args.prefix_len <= args.input_len:
        raise SystemExit("--prefix-len must be between 0 and --input-len")
    fractions = (
        [float(f) for f in args.sweep_shared_fractions.split(",")]
        if args.sweep_shared_fractions
        else [args.prefix_len / args.input_len]
    )
    if any(not 0 <= f <= 1 for f in fractions):
        raise SystemExit("shared fractions must be in [0, 1]")
    return fractions


async def benchmark(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--base-url``'s server over the sweep."""
    base_url = args.base_url.rstrip("/")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return await benchmark_server(args, args.label or base_url, base_url, headers)


async def benchmark_server(
    args: argparse.Namespace, label: str, base_url: str, headers: dict[str, str]
) -> list[dict[str, Any]]:
    """The sweep against one server, its rows labelled ``label``. The prompts and their arrival times depend only
    on the seed and the vocabulary (``--tokenizer``, else the vocab size the server reports), so servers measured
    one after another with the same tokenizer get the same requests."""
    fractions = shared_fractions(args)
    async with streaming_client(args.timeout) as client:
        card = await discover(client, base_url, headers)
        target = Target(base_url, args.model or card["id"], headers)
        vocab = token_vocabulary(args, card)
        warmup_prompt = random.Random(args.seed).choices(vocab, k=args.input_len)
        warmup = await send_request(client, target, warmup_prompt, args.output_len)
        if not warmup.success:
            raise SystemExit(f"the warm-up request to {label} failed: {warmup.error}")
        can_reset = True
        outcomes: dict[int, list[RequestResult]] = {point: [] for point in range(len(fractions))}
        durations = dict.fromkeys(outcomes, 0.0)
        round_ttfts: dict[int, list[float]] = {point: [] for point in outcomes}
        resets = dict.fromkeys(outcomes, True)
        for round_number, point in sweep_order(len(fractions), args.rounds):
            reset = await reset_prefix_cache(client, base_url, headers) if can_reset else None
            can_reset = reset is not None
            resets[point] = resets[point] and bool(reset)
            prefix_len = round(fractions[point] * args.input_len)
            # A fresh prefix per point and round, cache reset or not; the first round keeps the seeds of old runs.
            point_rng = random.Random(f"{args.seed}-{point}" + (f"-{round_number}" if round_number else ""))
            prompts = make_prompts(point_rng, vocab, args.num_prompts, args.input_len, prefix_len)
            results_of_round, duration = await run_point(
                client,
                target,
                prompts,
                args.output_len,
                args.request_rate,
                args.max_concurrency,
                point_rng,
                not args.disable_tqdm,
            )
            outcomes[point] += results_of_round
            durations[point] += duration
            round_ttfts[point].append(summarize(results_of_round, duration)["mean_ttft_ms"])
    rows = [
        {
            "label": label,
            "model": target.model,
            "shared_fraction": fraction,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "prefix_len": round(fraction * args.input_len),
            "output_len": args.output_len,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "max_concurrency": args.max_concurrency,
            "cache_reset": resets[point],
            "rounds": args.rounds,
            "mean_ttft_ms_by_round": round_ttfts[point],
            **summarize(outcomes[point], durations[point]),
        }
        for point, fraction in enumerate(fractions)
    ]
    check_ceilings(rows)
    for row in rows:
        print_summary(row)
    return rows


def load_results(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Rows from earlier ``--json`` files (one result, a list, or ``serve-compare``'s report); unlabelled rows take
    the file's name."""
    rows = []
    for path in paths:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "rows" in data:  # a ``bench serve-compare`` report
            data = data["rows"]
        for row in data if isinstance(data, list) else [data]:
            rows.append({"label": path.stem, **row})
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """TTFT and TPOT (mean, ms) against the shared fraction, one line per label; on a log scale when the
    values span more than a factor of 10 (an overloaded point next to cached ones)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.2))
    labels = list(dict.fromkeys(row["label"] for row in rows))
    panels = (("mean_ttft_ms", "time to first token"), ("mean_tpot_ms", "time per output token"))
    for ax, (key, title) in zip(figure.subplots(1, 2), panels, strict=True):
        for label in labels:
            points = sorted((r for r in rows if r["label"] == label), key=lambda r: r["shared_fraction"])
            ax.plot([r["shared_fraction"] for r in points], [r[key] for r in points], marker="o", label=label)
        ax.set_title(f"{title} (mean)")
        ax.set_xlabel("shared fraction of the prompt")
        values = [r[key] for r in rows if r[key] > 0]
        if values and max(values) > 10 * min(values):
            ax.set_yscale("log")
            ax.set_ylabel("ms (log scale)")
        else:
            ax.set_ylabel("ms")
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    if not args.base_url and not args.results:
        raise SystemExit("pass --base-url to run a benchmark, or --results with --plot to plot earlier runs")
    if args.base_url:
        rows = asyncio.run(benchmark(args))
        if args.json:
            args.json.write_text(json.dumps(rows if args.sweep_shared_fractions else rows[0], indent=2) + "\n")
    else:
        rows = []
    if args.plot:
        plot(rows + load_results(args.results or []), args.plot)
    return rows


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workload options ``serve`` shares with ``serve-compare``: prompts, arrivals, the sweep, its rounds."""
    p.add_argument("--num-prompts", type=positive_int, default=100, help="requests per point")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="run the sweep this many times, alternating forward and backward; each point over all its rounds",
    )
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--prefix-len", type=int, default=0, help="leading prompt tokens shared by every request")
    p.add_argument("--output-len", type=int, default=16, help="generated tokens per request (ignore_eos)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument(
        "--sweep-shared-fractions",
        nargs="?",
        const=DEFAULT_SWEEP,
        help=f"run one point per shared fraction of --input-len (default list: {DEFAULT_SWEEP}); "
        "overrides --prefix-len",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="prompts depend only on it: vary it to rerun on a server that cannot reset"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--disable-tqdm", action="store_true")


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "serve",
        help="online TTFT / TPOT / ITL of an OpenAI-compatible server on shared-prefix prompts",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--base-url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to request (default: the first one the server lists)")
    p.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--tokenizer", help="HF tokenizer whose non-special ids make the prompts (else --vocab-size)")
    p.add_argument("--vocab-size", type=int, help="draw prompt ids from [0, N) (default: what the server reports)")
    add_workload_arguments(p)
    p.add_argument("--label", help="name of this run in the JSON and the plot (default: the base URL)")
    p.add_argument("--json", type=Path, help="write the result here (a list when sweeping)")
    p.add_argument("--plot", type=Path, help="write a PNG of TTFT and TPOT against the shared fraction")
    p.add_argument("--results", type=Path, nargs="+", help="earlier --json files to plot alongside (e.g. vLLM's)")
    p.set_defaults(func=main)
