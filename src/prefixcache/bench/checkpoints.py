"""``prefixcache bench checkpoints``: prefix-cache hit rates of a hybrid recurrent model against full attention.

No model runs (torch-free): each request goes through a real :class:`~prefixcache.core.KVCacheManager` as the
engine's scheduler drives it, one at a time: looked up, admitted, prefilled in chunks of
``max_num_batched_tokens``, decoded token by token (its output ids are given: the next turn of a
conversation carries them), freed; ``take_transfers`` after every step, so a checkpoint is findable once its
step ran. Three workloads, each on a fresh cache, the same token ids for every model:

- **chat**: 8 conversations x 6 turns (a system prompt, then each turn the whole history plus a new user
  message), round-robin over the conversations;
- **document**: one 2,048-token document, then 32 questions about it;
- **few-shot**: one few-shot prefix branching into 3 variants, each shared by 8 requests, interleaved.

Models, all within the same ``--kv-cache-memory`` (float32):

- **full attention**: every layer attention, K/V per token (the reference);
- **hybrid**: Qwen3.5-shaped, three Gated DeltaNet layers per full-attention layer; each linear layer's state
  (its matrix state and convolution window) is about 1 MiB, so one sequence's state is tens of attention
  blocks. ``max_state_checkpoint_fraction`` of the memory holds checkpoints, one working state a running
  request (``max_num_seqs``) is taken from the rest, the attention blocks get what is left. Rows: every rule
  of the checkpoint policy, each rule left out (what it is worth), the finish and junction rules alone, the
  finish rule alone; then
- **aligned (vLLM-style)**: checkpoints only where a scheduled step ends on a block of a large aligned block
  size (``--aligned-block-size``, chunks cut to multiples of it), vLLM's "align" mode.

Chat-template message boundaries are passed as checkpoint hints (the system prompt, the few-shot prefix, each
variant, each turn's end). The goal: the hybrid's token hit rate at least 0.9 of full attention's.

``--ttft`` also runs a small Qwen3.5-shaped model with random weights (built in memory; the engine, torch) and
times to the first token: cold 2,048-token prompts against prompts whose first 80% (1,632 tokens, 102 blocks)
hit a junction checkpoint that an earlier request left. The goal: at most 0.3x.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from prefixcache.argtypes import positive_int
from prefixcache.config import parse_memory
from prefixcache.core import FULL_ATTENTION, KVCacheManager, Request
from prefixcache.core.kv_cache_groups import RECURRENT_STATE
from prefixcache.core.state_table import ALIGNED_POLICY, CheckpointPolicy, sparse_interval

# (prompt ids, output ids, hint positions) a request
Trace = list[tuple[list[int], list[int], tuple[int, ...]]]
FLOAT32 = 4


@dataclass(frozen=True, slots=True)
class CheckpointBenchConfig:
    """The model shapes (Qwen3.5-0.8B-like), the memory and the workloads."""

    num_layers: int = 24
    full_attention_interval: int = 4  # every fourth layer is full attention
    num_kv_heads: int = 2
    head_dim: int = 256
    linear_num_value_heads: int = 16
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_conv_kernel: int = 4
    block_size: int = 16
    aligned_block_size: int = 528
    kv_cache_memory: str = "2GiB"
    max_state_checkpoint_fraction: float = 0.25
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    vocab_size: int = 32_000
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_state_checkpoint_fraction < 1.0:
            fraction = self.max_state_checkpoint_fraction
            raise ValueError(f"max_state_checkpoint_fraction must be in [0, 1), got {fraction}")

    @property
    def num_full_layers(self) -> int:
        return self.num_layers // self.full_attention_interval

    def block_bytes(self, num_attention_layers: int, block_size: int) -> int:
        """K and V of one block in every attention layer."""
        return 2 * self.num_kv_heads * self.head_dim * block_size * FLOAT32 * num_attention_layers

    @property
    def state_bytes(self) -> int:
        """One sequence's state in every linear layer: the matrix state and the convolution's window."""
        matrix = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        conv_dim = 2 * self.linear_num_key_heads * self.linear_key_head_dim + matrix // self.linear_key_head_dim
        per_layer = (matrix + conv_dim * (self.linear_conv_kernel - 1)) * FLOAT32
        return per_layer * (self.num_layers - self.num_full_layers)


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def chat_trace(rng: random.Random, vocab: int, conversations=8, turns=6, system=256, user=64, answer=96) -> Trace:
    histories = [(_tokens(rng, system, vocab), [system]) for _ in range(conversations)]
    trace: Trace = []
    for _ in range(turns):
        for c, (history, hints) in enumerate(histories):
            prompt = history + _tokens(rng, user, vocab)
            output = _tokens(rng, answer, vocab)
            trace.append((prompt, output, tuple(hints)))
            histories[c] = (prompt + output, [*hints, len(prompt), len(prompt) + answer])
    return trace


def document_trace(rng: random.Random, vocab: int, document=2048, questions=32, question=48, answer=32) -> Trace:
    doc = _tokens(rng, document, vocab)
    return [(doc + _tokens(rng, question, vocab), _tokens(rng, answer, vocab), (document,)) for _ in range(questions)]


def few_shot_trace(rng: random.Random, vocab: int, prefix=1024, variants=3, per_variant=8, variant=256, question=64,
                   answer=32) -> Trace:  # fmt: skip
    shared = _tokens(rng, prefix, vocab)
    heads = [shared + _tokens(rng, variant, vocab) for _ in range(variants)]
    return [
        (heads[v] + _tokens(rng, question, vocab), _tokens(rng, answer, vocab), (prefix, prefix + variant))
        for _ in range(per_variant)
        for v in range(variants)
    ]


WORKLOADS = {"chat": chat_trace, "document": document_trace, "few-shot": few_shot_trace}


def serve(manager: KVCacheManager, request: Request, outputs: list[int], chunk: int) -> None:
    """One request as the engine runs it alone: chunked prefill, then each output token sampled and, but for the
    last, computed; then freed."""

    def run_step(num_new: int, hit: Any = None) -> None:
        if manager.allocate_slots(request, num_new, hit) is None:
            raise ValueError(f"a request of {request.num_tokens} tokens does not fit in the cache")
        manager.take_transfers()

    hit = manager.find_prefix(request)
    run_step(min(chunk, request.num_tokens - hit.num_tokens), hit)
    while request.num_computed_tokens < request.num_tokens:
        run_step(min(chunk, request.num_tokens - request.num_computed_tokens))
    for i, token in enumerate(outputs):
        request.append_output_token_ids([token])
        if i + 1 < len(outputs):
            run_step(1)
    manager.free(request)


def replay(manager: KVCacheManager, trace: Trace, chunk: int) -> dict[str, Any]:
    for i, (prompt, outputs, hints) in enumerate(trace):
        serve(manager, Request(f"r{i}", prompt, checkpoint_hints=hints), outputs, chunk)
    stats = manager.stats
    result: dict[str, Any] = {"hit_rate": stats.hit_rate, "hits": stats.hits, "queries": stats.queries}
    if manager.state is not None:
        result["checkpoints"] = asdict(manager.state.stats)
    return result


def models(config: CheckpointBenchConfig) -> dict[str, dict[str, Any]]:
    """Each model's manager arguments within the same memory (see the module's docstring)."""
    memory = parse_memory(config.kv_cache_memory)
    full_block = config.block_bytes(config.num_layers, config.block_size)
    state = config.state_bytes
    num_checkpoints = int(memory * config.max_state_checkpoint_fraction) // state
    rest = memory - (num_checkpoints + config.max_num_seqs) * state
    if rest <= 0:
        raise ValueError(f"--kv-cache-memory {config.kv_cache_memory} holds no attention blocks beside the states")
    every = sparse_interval(config.max_model_len, config.block_size, num_checkpoints)
    full_policy = CheckpointPolicy(sparse_every_blocks=every)
    hybrid = {
        "block_size": config.block_size,
        "num_blocks": rest // config.block_bytes(config.num_full_layers, config.block_size),
        "groups": (FULL_ATTENTION, RECURRENT_STATE),
        "num_state_slots": config.max_num_seqs,
        "num_checkpoint_slots": num_checkpoints,
    }
    rows: dict[str, dict[str, Any]] = {
        "full attention": {"block_size": config.block_size, "num_blocks": memory // full_block},
        "hybrid, every rule": {**hybrid, "checkpoint_policy": full_policy},
        "  without finish": {**hybrid, "checkpoint_policy": replace(full_policy, at_finish=False)},
        "  without junctions": {**hybrid, "checkpoint_policy": replace(full_policy, at_junctions=False)},
        "  without sparse": {**hybrid, "checkpoint_policy": replace(full_policy, sparse_every_blocks=0)},
        "  without hints": {**hybrid, "checkpoint_policy": replace(full_policy, at_hints=False)},
        "  finish + junctions": {**hybrid, "checkpoint_policy": CheckpointPolicy(at_hints=False)},
        "  finish only": {**hybrid, "checkpoint_policy": CheckpointPolicy(at_junctions=False, at_hints=False)},
    }
    aligned = config.aligned_block_size
    rows["aligned (vLLM-style)"] = {
        **hybrid,
        "block_size": aligned,
        "num_blocks": rest // config.block_bytes(config.num_full_layers, aligned),
        "checkpoint_policy": ALIGNED_POLICY,
    }
    return rows


def qwen35_shaped(seed: int = 0) -> Any:
    """A small Qwen3.5 text model (8 layers: 3 Gated DeltaNet per full attention) with random weights, in memory."""
    from transformers import Qwen3_5TextConfig

    from prefixcache.bench.hybrid import random_model

    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    hf_config = Qwen3_5TextConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, layer_types=layer_types * 2,
        max_position_embeddings=4096, eos_token_id=None,
    )  # fmt: skip
    return random_model(hf_config, "qwen3.5-shaped", seed, 0.05)


def ttft(repeats: int = 3, seed: int = 0) -> dict[str, Any]:
    """Seconds to the first token of cold 2,048-token prompts and of ones whose first 1,632 tokens hit."""
    from prefixcache.config import EngineConfig
    from prefixcache.engine.core import EngineCore
    from prefixcache.engine.messages import EngineCoreRequest
    from prefixcache.engine.sampling_params import SamplingParams

    loaded = qwen35_shaped(seed)
    config = EngineConfig(dtype="float32", kv_cache_memory="512MiB", max_num_seqs=4, max_model_len=4096)
    core = EngineCore(config, loaded=loaded)
    rng = random.Random(seed)
    one_token = SamplingParams(max_tokens=1, ignore_eos=True)

    def first_token(name: str, prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        core.add_request(EngineCoreRequest(name, prompt, one_token))
        while True:
            for output in core.step().outputs:
                if output.request_id == name and output.finish_reason is not None:
                    return time.perf_counter() - start, output.num_cached_tokens

    document = _tokens(rng, 2048, 1024)
    first_token("warm-up", _tokens(rng, 2048, 1024))
    first_token("document", document)
    first_token("junction", document[:1638] + _tokens(rng, 410, 1024))  # leaves its checkpoint at 102 blocks
    cold, cached = [], []
    for i in range(repeats):  # interleaved, so that a change in the machine's load reaches both alike
        cold.append(first_token(f"cold-{i}", _tokens(rng, 2048, 1024)))
        cached.append(first_token(f"hit-{i}", document[:1638] + _tokens(rng, 410, 1024)))
    return {
        "cold_s": statistics.median(t for t, _ in cold),
        "cached_s": statistics.median(t for t, _ in cached),
        "cached_tokens": [n for _, n in cached],
        "ratio": statistics.median(t for t, _ in cached) / statistics.median(t for t, _ in cold),
    }


def run(config: CheckpointBenchConfig, json_path: Path | None = None, with_ttft: bool = False) -> dict:
    rows = models(config)
    report: dict[str, Any] = {
        "config": asdict(config),
        "machine": {"python": platform.python_version(), "processor": platform.machine()},
        "state_bytes": config.state_bytes,
        "models": {name: {k: v for k, v in kwargs.items() if k != "groups"} for name, kwargs in rows.items()},
        "results": {},
    }
    for name, kwargs in rows.items():
        kwargs = dict(kwargs)
        policy = kwargs.get("checkpoint_policy")
        if policy is not None:
            report["models"][name]["checkpoint_policy"] = asdict(policy)
        chunk = config.max_num_batched_tokens
        if kwargs["block_size"] != config.block_size:  # vLLM's align mode cuts chunks to whole blocks
            chunk = max(kwargs["block_size"], chunk // kwargs["block_size"] * kwargs["block_size"])
        for workload, make in WORKLOADS.items():
            trace = make(random.Random(config.seed), config.vocab_size)
            manager = KVCacheManager(hash_algo="xxhash", **kwargs)
            report["results"].setdefault(workload, {})[name] = replay(manager, trace, chunk)
    if with_ttft:
        report["ttft"] = ttft(seed=config.seed)
    print(format_report(report))
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def format_report(report: dict) -> str:
    cfg = report["config"]
    names = list(report["models"])
    hybrid = report["models"]["hybrid, every rule"]
    full_blocks = report["models"]["full attention"]["num_blocks"]
    lines = [
        f"Qwen3.5-shaped: {cfg['num_layers']} layers, 1 full attention per {cfg['full_attention_interval']} "
        f"({cfg['num_kv_heads']} KV heads of {cfg['head_dim']}), state {report['state_bytes'] / 2**20:.1f} MiB a "
        f"sequence; float32 in {cfg['kv_cache_memory']}: full attention {full_blocks:,} "
        f"blocks; hybrid {hybrid['num_blocks']:,} blocks + {cfg['max_num_seqs']} working states + "
        f"{hybrid['num_checkpoint_slots']} checkpoints ({cfg['max_state_checkpoint_fraction']:.0%} of the memory), "
        f"sparse every {hybrid['checkpoint_policy']['sparse_every_blocks']} blocks; aligned block "
        f"{cfg['aligned_block_size']}; blocks of {cfg['block_size']}, chunks of {cfg['max_num_batched_tokens']}; "
        f"python {report['machine']['python']}",
        f"{'token hit rate':<24}" + "".join(f"{w:>12}" for w in WORKLOADS) + "   (/ full attention)",
    ]
    for name in names:
        rates = [report["results"][w][name]["hit_rate"] for w in WORKLOADS]
        references = [report["results"][w]["full attention"]["hit_rate"] for w in WORKLOADS]
        ratios = [rate / max(reference, 1e-12) for rate, reference in zip(rates, references, strict=True)]
        lines.append(
            f"{name:<24}" + "".join(f"{r:>12.3f}" for r in rates) + "   " + " ".join(f"{q:.3f}" for q in ratios)
        )
    lines.append("checkpoints of 'hybrid, every rule' (saved / hit / evicted, by rule):")
    for workload in WORKLOADS:
        cp = report["results"][workload]["hybrid, every rule"]["checkpoints"]
        parts = [f"{rule} {cp['saved'][rule]}/{cp['hits'][rule]}/{cp['evicted'][rule]}" for rule in cp["saved"]]
        lines.append(f"  {workload:<10} " + ", ".join(parts))
    if "ttft" in report:
        t = report["ttft"]
        lines.append(
            f"TTFT, small Qwen3.5-shaped model, 2,048-token prompt: cold {t['cold_s'] * 1000:,.0f} ms, first "
            f"{t['cached_tokens'][0]:,} tokens cached {t['cached_s'] * 1000:,.0f} ms: {t['ratio']:.3f}x (median of "
            f"{len(t['cached_tokens'])})"
        )
    return "\n".join(lines)


def register(bench: argparse._SubParsersAction) -> None:
    defaults = CheckpointBenchConfig()
    p = bench.add_parser(
        "checkpoints", help="hit rates of a Qwen3.5-shaped hybrid (state checkpoints) against full attention",
        description=__doc__,
    )  # fmt: skip
    p.add_argument("--kv-cache-memory", default=defaults.kv_cache_memory, help="every model's memory")
    p.add_argument(
        "--max-state-checkpoint-fraction", type=float, default=defaults.max_state_checkpoint_fraction,
        help="share of the memory for state checkpoints",
    )  # fmt: skip
    p.add_argument("--aligned-block-size", type=positive_int, default=defaults.aligned_block_size)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--ttft", action="store_true", help="also time the first token, cold and 80%% cached (torch)")
    p.add_argument("--json", type=Path, help="also write the report as JSON here")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> None:
    config = CheckpointBenchConfig(
        kv_cache_memory=args.kv_cache_memory,
        max_state_checkpoint_fraction=args.max_state_checkpoint_fraction,
        aligned_block_size=args.aligned_block_size,
        seed=args.seed,
    )
    run(config, args.json, with_ttft=args.ttft)
