"""``prefixcache bench noisy-neighbour``: whether one tenant's flood can push another tenant's prefix out.

One ``prefixcache serve`` on loopback with two API keys (two tenants, salted apart). Tenant A sends chat
questions behind one long system prompt, as Poisson arrivals at ``--a-rate``; tenant B floods unique
completion prompts (token ids) at ``--flood-ratio`` times that rate. The KV cache is sized to hold
``--cache-fraction`` of B's whole flood, so under plain LRU B's blocks push A's system prompt out between
two of A's questions. Three runs in one invocation, the prefix cache reset before each:

- ``alone``: A without the flood (the reference);
- ``lru``: A with the flood, A's requests without directives (today's behaviour: least recently used first);
- ``cache_control``: A with the flood, A's system message marked ``cache_control`` (ttl ``1h``: priority 80).

The three runs are made once per ``--scheduling-policy`` (a server each, all up at once, the runs interleaved
so that each pair runs under the same load): ``fcfs`` serves A's requests after B's earlier ones,
``cache-aware`` the fewest uncached tokens first.

``--random-weights`` serves a small Llama with random weights and ``--model``'s tokenizer instead: at the issue's
token sizes a CPU computes a 135M model's prompts too slowly to keep up with any flood, and what is measured, A's
hits and waits, is the cache's and the scheduler's, whatever the tokens say.

Reported for A in each run: the token hit rate (the server's ``cached_tokens`` / prompt tokens) and TTFT, and
against ``alone`` (of the same policy) the ratios with their goals (hit rate at least 0.95 of it, mean TTFT at
most 1.2 times it). The hit rate says what A's prefix lost; TTFT also holds A's wait behind B's prefill, which the
scheduling policy decides. For B: its mean TTFT and its throughput (requests/s over the flood's wall time), and
with both policies the throughput of ``cache-aware`` over ``fcfs``: what serving A first costs the flood.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from prefixcache.argtypes import positive_int
from prefixcache.bench.live import Process, served_model
from prefixcache.bench.offload_live import Bench
from prefixcache.bench.offload_live import _fraction as fraction
from prefixcache.bench.serve import Messages, Target, reset_prefix_cache, run_point, send_request, summarize
from prefixcache.config import DTYPES, SCHEDULING_POLICIES, EngineConfig
from prefixcache.engine.args import config_default
from prefixcache.http.retention import BREAKPOINT_PRIORITY

RUNS = {"alone": "A alone", "lru": "A + flood, plain LRU", "cache_control": "A + flood, cache_control 1h"}
HIT_RATE_GOAL = 0.95  # A's hit rate with cache_control over A's alone, at least
TTFT_GOAL = 1.2  # A's mean TTFT with cache_control over A's alone, at most
TTL = "1h"
KEYS = {"A": "tenant-a-key", "B": "tenant-b-key"}
_NOT_OPTIONS = {"func", "command", "bench", "log_level"}  # the CLI's own, not this benchmark's


def _positive(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


@dataclass(frozen=True, slots=True)
class Workload:
    """A's system prompt and questions (text: they go through the chat template) and B's flood (token ids)."""

    system: str
    questions: list[str]
    flood: list[list[int]]
    system_tokens: int  # what the tokenizer makes of ``system`` alone (the template adds its markers)

    @classmethod
    def make(cls, tokenizer: Any, args: argparse.Namespace) -> Workload:
        rng = random.Random(f"{args.seed}-noisy")
        special = set(tokenizer.all_special_ids)
        ids = sorted(i for i in tokenizer.get_vocab().values() if i not in special)

        def text(length: int) -> str:
            """Random text of about ``length`` tokens: random ids decoded, cut to ``length`` once re-encoded."""
            encoded = tokenizer.encode(tokenizer.decode(rng.choices(ids, k=length)), add_special_tokens=False)
            return tokenizer.decode(encoded[:length])

        system = text(args.system_len)
        num_flood = round(args.flood_ratio * args.a_requests)
        return cls(
            system=system,
            questions=[text(args.question_len) for _ in range(args.a_requests)],
            flood=[rng.choices(ids, k=args.flood_len) for _ in range(num_flood)],
            system_tokens=len(tokenizer.encode(system, add_special_tokens=False)),
        )

    def conversations(self, cache_control: bool) -> list[Messages]:
        """A's requests: the system prompt (marked ``cache_control`` or not), then one question each."""
        system: dict[str, Any] = {"role": "system", "content": self.system}
        if cache_control:
            system["cache_control"] = {"type": "ephemeral", "ttl": TTL}
        return [[system, {"role": "user", "content": question}] for question in self.questions]

    @property
    def flood_tokens(self) -> int:
        return sum(map(len, self.flood))


@dataclass(frozen=True, slots=True)
class Sizing:
    """The KV cache this benchmark gives the server, and what it means for A's prefix under plain LRU."""

    blocks: int
    flood_blocks: int  # B's whole flood (prompts and outputs)
    a_blocks: int  # one of A's requests (system prompt, question, template, output), rounded up
    between_a_blocks: int  # blocks B writes, on average, between two of A's requests

    @classmethod
    def make(cls, workload: Workload, args: argparse.Namespace) -> Sizing:
        per_flood = -(-(args.flood_len + args.output_len) // args.block_size)
        # The chat template's markers are a few tokens; one block covers them at any block size used here.
        a_tokens = workload.system_tokens + args.question_len + args.output_len
        a_blocks = -(-a_tokens // args.block_size) + 1
        flood_blocks = per_flood * len(workload.flood)
        blocks = math.ceil(args.cache_fraction * flood_blocks)
        if blocks < a_blocks + per_flood:
            raise SystemExit(
                f"a KV cache of {blocks} blocks ({args.cache_fraction:g} of B's flood) cannot hold one of A's requests "
                f"({a_blocks} blocks) beside one of B's ({per_flood}); use more --a-requests or a larger "
                "--cache-fraction"
            )
        return cls(blocks, flood_blocks, a_blocks, round(args.flood_ratio * per_flood))

    def describe(self, args: argparse.Namespace, workload: Workload, kv_bytes_per_token: int) -> str:
        tokens = self.blocks * args.block_size
        room = self.blocks - self.a_blocks
        fate = "must evict part of A's prefix" if self.between_a_blocks > room else "can keep A's prefix"
        return (
            f"KV cache {self.blocks} blocks = {tokens:,} tokens (--num-gpu-blocks-override {self.blocks}, "
            f"= --kv-cache-memory {tokens * kv_bytes_per_token / 2**20:.1f}MiB) holds "
            f"{self.blocks / self.flood_blocks:.2f} of B's flood ({len(workload.flood)} prompts x {args.flood_len} + "
            f"{args.output_len} tokens = "
            f"{self.flood_blocks} blocks); A's request is about {self.a_blocks} blocks, its system prompt "
            f"{workload.system_tokens} tokens. Between two of A's requests B writes about {self.between_a_blocks} "
            f"blocks into the {room} beside A's: plain LRU {fate}"
        )


@dataclass(slots=True)
class NoisyBench:
    """The server both tenants share and the workload; one ``run`` per row of the report."""

    bench: Bench
    server: Process
    model: str
    workload: Workload

    def target(self, tenant: str) -> Target:
        return Target(self.server.url, self.model, {"Authorization": f"Bearer {KEYS[tenant]}"})

    async def reset(self, client: httpx.AsyncClient) -> None:
        if not await reset_prefix_cache(client, self.server.url, self.target("A").headers):
            raise SystemExit(f"the server did not reset its prefix cache:\n{self.server.log()[-3000:]}")

    async def warm_up(self) -> None:
        """One request of each kind, so first-call costs land outside the runs."""
        async with self.bench.client() as client:
            a = await send_request(client, self.target("A"), self.workload.conversations(True)[0], 2)
            b = await send_request(client, self.target("B"), self.workload.flood[0], 2)
        for result in (a, b):
            if not result.success:
                raise SystemExit(f"the warm-up failed: {result.error}\n{self.server.log()[-3000:]}")

    async def run(self, name: str) -> dict[str, Any]:
        """A's requests (and B's flood unless ``alone``), both Poisson, from a reset cache; both tenants' summaries.
        A's arrival times are the same in every run, B's (and the order of its prompts) in both flooded runs: alone,
        A's later questions wait for its first, cold one too, so the runs differ only by the flood and the
        directive."""
        args = self.bench.args
        async with self.bench.client() as client:
            await self.reset(client)
            progress = self.bench.announce(RUNS[name])
            sends = [
                run_point(
                    client,
                    self.target("A"),
                    self.workload.conversations(cache_control=name == "cache_control"),
                    args.output_len,
                    args.a_rate,
                    None,
                    random.Random(f"{args.seed}-a"),
                    progress,
                )
            ]
            if name != "alone":
                sends.append(
                    run_point(
                        client,
                        self.target("B"),
                        self.workload.flood,
                        args.output_len,
                        args.flood_ratio * args.a_rate,
                        None,
                        random.Random(f"{args.seed}-b"),
                        progress,
                    )
                )
            outcomes = await asyncio.gather(*sends)
        summaries = {}
        for tenant, (results, duration) in zip("AB", outcomes, strict=False):
            summary = summarize(results, duration, percentiles=(90,))
            if summary["failed"]:
                raise SystemExit(
                    f"{RUNS[name]}: {summary['failed']} of {tenant}'s requests failed: {summary['errors']}\n"
                    f"{self.server.log()[-3000:]}"
                )
            summaries[tenant] = summary
        return {"label": RUNS[name], "A": summaries["A"], "B": summaries.get("B")}


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A's hit rate and mean TTFT in each flooded run over A's alone, and the goals for cache_control."""
    alone = runs["alone"]["A"]
    ratios = {
        name: {
            "hit_rate_ratio": runs[name]["A"]["hit_rate"] / alone["hit_rate"] if alone["hit_rate"] else None,
            "ttft_ratio": runs[name]["A"]["mean_ttft_ms"] / alone["mean_ttft_ms"],
        }
        for name in ("lru", "cache_control")
    }
    ours = ratios["cache_control"]
    return {
        "ratios": ratios,
        "goals": {"hit_rate_ratio_at_least": HIT_RATE_GOAL, "ttft_ratio_at_most": TTFT_GOAL},
        "hit_rate_goal_met": ours["hit_rate_ratio"] is not None and ours["hit_rate_ratio"] >= HIT_RATE_GOAL,
        "ttft_goal_met": ours["ttft_ratio"] <= TTFT_GOAL,
    }


def flood_cost(policies: dict[str, dict[str, Any]]) -> dict[str, float] | None:
    """B's throughput under ``cache-aware`` over ``fcfs`` in each flooded run; None without both policies."""
    if not {"fcfs", "cache-aware"} <= policies.keys():
        return None
    ours, fcfs = policies["cache-aware"]["runs"], policies["fcfs"]["runs"]
    return {
        name: ours[name]["B"]["request_throughput"] / fcfs[name]["B"]["request_throughput"]
        for name in ("lru", "cache_control")
    }


def random_checkpoint(model_dir: Path, vocab_size: int, out: Path, seed: int) -> Path:
    """A Llama of 2 layers, 64 wide, with random weights and ``model_dir``'s tokenizer, saved to ``out`` (the
    servers load a folder); it computes a 1,024-token prompt in a few tens of ms on a CPU core."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="prefixcache-noisy-") as workdir:
        return run_in(args, Path(workdir))


def run_in(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The benchmark, its servers' logs (and ``--random-weights``' checkpoint) in ``workdir``."""
    import torch
    from transformers import AutoTokenizer

    from prefixcache.model.loader import read_config

    model_dir, model_name, config = served_model(args.model)
    if args.random_weights:
        model_dir = random_checkpoint(model_dir, config.vocab_size, workdir / "model", args.seed)
        model_name, config = f"{model_name}'s tokenizer, 2x64 Llama (random weights)", read_config(model_dir)
    engine = EngineConfig(dtype=args.dtype)  # the server runs this machine's resolution of auto too
    args = argparse.Namespace(**{**vars(args), "dtype": engine.dtype, "model": str(model_dir)})
    workload = Workload.make(AutoTokenizer.from_pretrained(model_dir), args)
    sizing = Sizing.make(workload, args)
    kv_bytes_per_token = config.kv_bytes_per_token(getattr(torch, args.dtype).itemsize)
    machine = {
        "cores": os.cpu_count() or 0,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_before": os.getloadavg(),
    }
    print(
        f"noisy neighbour: {model_name}, {args.dtype}, blocks of {args.block_size} tokens; A: {args.a_requests} "
        f"questions of {args.question_len} tokens behind a {workload.system_tokens}-token system prompt at "
        f"{args.a_rate:g} req/s; B: {len(workload.flood)} unique prompts of {args.flood_len} tokens at "
        f"{args.flood_ratio * args.a_rate:g} req/s; {args.output_len} output tokens a request; at most "
        f"{args.max_num_seqs} running, {args.max_num_batched_tokens} tokens a step; "
        f"{machine['cores']} cores, load average {'/'.join(f'{x:.2f}' for x in machine['load_average_before'])}"
    )
    print(sizing.describe(args, workload, kv_bytes_per_token))
    bench = Bench(args, workdir, config.vocab_size, kv_bytes_per_token)
    keys = [option for key in KEYS.values() for option in ("--api-key", key)]
    extra = ["--num-gpu-blocks-override", str(sizing.blocks), "--enable-reset-prefix-cache", *keys]
    extra += ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    with contextlib.ExitStack() as stack:
        # Every policy's server up at once (an idle one sleeps), the runs interleaved: the paired runs of two
        # policies are minutes apart, not half an hour, on a machine whose load drifts.
        servers = {
            policy: bench.launch(stack, f"server-{policy}", [*extra, "--scheduling-policy", policy])
            for policy in dict.fromkeys(args.scheduling_policy)
        }
        benches = {}
        for policy, server in servers.items():
            server.wait_ready(args.startup_timeout)
            headers = {"Authorization": f"Bearer {KEYS['A']}"}
            model = httpx.get(f"{server.url}/v1/models", headers=headers, timeout=10)
            benches[policy] = NoisyBench(bench, server, model.json()["data"][0]["id"], workload)
            asyncio.run(benches[policy].warm_up())
        runs: dict[str, dict[str, dict[str, Any]]] = {policy: {} for policy in servers}
        for name in RUNS:
            for policy, noisy in benches.items():
                started = time.perf_counter()
                runs[policy][name] = asyncio.run(noisy.run(name))
                runs[policy][name]["wall_s"] = time.perf_counter() - started
                print(f"{policy}, {RUNS[name]}: done in {runs[policy][name]['wall_s']:.0f}s", flush=True)
    policies = {policy: {"runs": runs[policy], **compare(runs[policy])} for policy in servers}
    machine["load_average_after"] = os.getloadavg()
    options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in _NOT_OPTIONS}
    report = {
        "config": {
            **options,
            "model": model_name,
            "system_tokens": workload.system_tokens,
            "flood_requests": len(workload.flood),
            "cache_blocks": sizing.blocks,
            "cache_tokens": sizing.blocks * args.block_size,
            "cache_share_of_flood": sizing.blocks / sizing.flood_blocks,
            "cache_control_priority": BREAKPOINT_PRIORITY[TTL],
        },
        "machine": machine,
        "policies": policies,
        "flood_throughput_ratio": flood_cost(policies),
    }
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


def print_report(report: dict[str, Any]) -> None:
    print(
        f"\n{'policy':<13}{'run':<30}{'A hit rate':>11}{'A TTFT mean':>13}{'median':>9}{'p90':>9}{'B TTFT mean':>13}"
        f"{'B req/s':>9}{'wall':>7}"
    )
    for policy, result in report["policies"].items():
        for row in result["runs"].values():
            a, b = row["A"], row["B"]
            flood = f"{b['mean_ttft_ms']:>11.0f}ms{b['request_throughput']:>9.4f}" if b else f"{'-':>13}{'-':>9}"
            print(
                f"{policy:<13}{row['label']:<30}{a['hit_rate'] or 0.0:>11.3f}{a['mean_ttft_ms']:>11.0f}ms"
                f"{a['median_ttft_ms']:>7.0f}ms{a['p90_ttft_ms']:>7.0f}ms{flood}{row['wall_s']:>6.0f}s"
            )
    met = {True: "met", False: "NOT met"}
    for policy, result in report["policies"].items():
        for name in ("lru", "cache_control"):
            ratios = result["ratios"][name]
            hit = "n/a" if ratios["hit_rate_ratio"] is None else f"{ratios['hit_rate_ratio']:.3f}"
            print(
                f"{policy}, {RUNS[name]}: A's hit rate {hit} of alone, A's mean TTFT {ratios['ttft_ratio']:.2f}x alone"
            )
        print(
            f"{policy}: goals with cache_control: hit rate >= {HIT_RATE_GOAL} of alone: "
            f"{met[result['hit_rate_goal_met']]}; mean TTFT <= {TTFT_GOAL}x alone: {met[result['ttft_goal_met']]}"
        )
    cost = report["flood_throughput_ratio"]
    if cost is not None:
        print(
            "B's throughput with cache-aware over fcfs: "
            + ", ".join(f"{RUNS[name]} {ratio:.3f}" for name, ratio in cost.items())
        )
    load = report["machine"]["load_average_after"]
    print(f"load average after: {'/'.join(f'{x:.2f}' for x in load)}")


def register(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "noisy-neighbour",
        help="live: tenant A's cache_control system prompt against tenant B's flood (alone, plain LRU, cache_control)",
        description=__doc__,
    )
    p.add_argument("--model", help="HF checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="serve a 2-layer, 64-wide Llama with random weights and --model's tokenizer: the issue's token sizes at "
        "a speed a CPU keeps up with",
    )
    p.add_argument("--dtype", default=config_default("dtype"), choices=DTYPES, help="as prefixcache serve --dtype")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--output-len", type=positive_int, default=8, help="generated tokens per request (ignore_eos)")
    p.add_argument("--seed", type=int, default=0, help="the prompts and arrivals depend only on it")
    p.add_argument("--system-len", type=positive_int, default=2048, help="tokens of A's system prompt")
    p.add_argument("--question-len", type=positive_int, default=32, help="tokens of each of A's questions")
    p.add_argument("--a-requests", type=positive_int, default=6, help="A's questions per run")
    p.add_argument("--a-rate", type=_positive, default=0.1, help="A's requests/s (Poisson)")
    p.add_argument("--flood-len", type=positive_int, default=1024, help="tokens of each of B's unique prompts")
    p.add_argument("--flood-ratio", type=_positive, default=4.0, help="B's request rate (and count) over A's")
    p.add_argument(
        "--cache-fraction", type=fraction, default=0.25, help="KV cache size as a fraction of B's whole flood"
    )
    p.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=config_default("max_num_seqs"),
        help="the server's cap on requests running at once: running requests' blocks are not free, so no "
        "priority keeps A's prefix once B's running requests need the whole cache",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=config_default("max_num_batched_tokens"),
        help="the server's tokens per step: a step is never cut short, so a question arriving during one of B's "
        "prefill steps waits for its end",
    )
    p.add_argument(
        "--scheduling-policy",
        nargs="+",
        choices=SCHEDULING_POLICIES,
        default=list(SCHEDULING_POLICIES),
        help="the server's --scheduling-policy; the three runs are made once per policy given",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for the server to come up")
    p.add_argument("--json", type=Path, help="write the report as JSON here")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=run)
