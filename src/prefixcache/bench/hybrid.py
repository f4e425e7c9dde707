"""``prefixcache bench hybrid``: the hybrid KV cache manager against the mask-only layout, side by side.

A Gemma-3-shaped model with random weights (five layers of a 1,024-token sliding window per full-attention
layer, a small hidden size so that it runs on a CPU) runs the same token ids under both layouts in one
process:

- **memory**: the KV cache bytes one long request (8,192 prompt tokens by default) holds, at its peak during
  the chunked prefill and while it decodes (the mask-only layout keeps every layer's blocks; the hybrid one
  gives a sliding layer's blocks back once they left its window), and how many such requests run at once in
  the same ``--kv-cache-memory``;
- **hits are not lost**: a 4,096-token shared document and 32 questions: the prefix hit rate of both layouts,
  and whether their greedy outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixcache.argtypes import positive_int
from prefixcache.config import parse_memory
from prefixcache.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch loads only when the benchmark runs, so the CLI parser stays light
    from prefixcache.engine.core import EngineCore
    from prefixcache.model import LoadedModel

LAYOUTS = {"mask-only": True, "hybrid": False}  # name -> disable_hybrid_kv_cache_manager


@dataclass(frozen=True, slots=True)
class HybridBenchConfig:
    """The model's shape and the two workloads."""

    num_layers: int = 6
    sliding_window_pattern: int = 6  # every sixth layer is full attention (Gemma 3)
    sliding_window: int = 1024
    hidden_size: int = 64
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 32
    vocab_size: int = 512
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    kv_cache_memory: str = "32MiB"
    prompt_tokens: int = 8192
    # Long enough that the first long request still decodes when the last one is admitted.
    memory_output_tokens: int = 48
    num_long_requests: int = 10
    document_tokens: int = 4096
    num_questions: int = 32
    question_tokens: int = 32
    answer_tokens: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_layers % self.sliding_window_pattern:
            raise ValueError("num_layers must be a multiple of sliding_window_pattern")
        parse_memory(self.kv_cache_memory)


def gemma3_shaped(config: HybridBenchConfig) -> LoadedModel:
    """A Gemma 3 text model of that shape with random weights, built in memory (nothing is read or written)."""
    from transformers import Gemma3TextConfig

    layer_types = [
        "full_attention" if (i + 1) % config.sliding_window_pattern == 0 else "sliding_attention"
        for i in range(config.num_layers)
    ]
    hf_config = Gemma3TextConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=2 * config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        sliding_window=config.sliding_window,
        layer_types=layer_types,
        max_position_embeddings=2 * (config.prompt_tokens + config.memory_output_tokens),
        eos_token_id=None,
    )
    return random_model(hf_config, "gemma3-shaped", config.seed, 0.5)


def random_model(hf_config: Any, name: str, seed: int, std: float) -> LoadedModel:
    """The decoder of a transformers config with every parameter drawn from N(0, std), built in memory (the
    default init leaves norms at one: draw everything, so no layer is inert)."""
    import torch

    from prefixcache.model import DecoderForCausalLM, LoadedModel, ModelConfig

    model_config = ModelConfig.from_hf_config(hf_config)
    torch.manual_seed(seed)
    model = DecoderForCausalLM(model_config).eval().requires_grad_(False)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, std)
    return LoadedModel(model, model_config, None, Path("."), f"{name} (random weights)", f"random-{name}-seed-{seed}")


def make_engine(loaded: LoadedModel, config: HybridBenchConfig, disable_hybrid: bool, **overrides: Any) -> EngineCore:
    from prefixcache.config import EngineConfig
    from prefixcache.engine.core import EngineCore

    fields = dict(
        block_size=config.block_size,
        kv_cache_memory=config.kv_cache_memory,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=256,
        disable_hybrid_kv_cache_manager=disable_hybrid,
        seed=config.seed,
        dtype="float32",  # the random model's weights
    )
    return EngineCore(EngineConfig(**(fields | overrides)), loaded=loaded)


def _submit(core: EngineCore, prompts: list[list[int]], max_tokens: int, prefix: str) -> None:
    from prefixcache.engine.messages import EngineCoreRequest

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"{prefix}{i}", prompt, params))


def _used_bytes(core: EngineCore) -> int:
    """KV bytes held by running requests now (a block of the hybrid pool spans one group's layers)."""
    return (core.manager.num_usable_blocks - core.manager.num_free_blocks) * core.block_bytes


def memory_per_request(loaded: LoadedModel, config: HybridBenchConfig, disable_hybrid: bool) -> dict[str, float]:
    """One long request alone: the KV bytes it holds at its peak (chunked prefill) and while it decodes."""
    core = make_engine(loaded, config, disable_hybrid)
    rng = random.Random(config.seed)
    _submit(core, [[rng.randrange(3, config.vocab_size) for _ in range(config.prompt_tokens)]], 4, "mem-")
    peak = decoding = 0
    start = time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
        used = _used_bytes(core)
        peak = max(peak, used)
        if core.has_unfinished_requests():
            decoding = used
    core.close()
    return {"peak_bytes": peak, "decode_bytes": decoding, "elapsed_s": time.perf_counter() - start}


def concurrency(loaded: LoadedModel, config: HybridBenchConfig, disable_hybrid: bool) -> dict[str, float]:
    """``num_long_requests`` long requests at once in ``kv_cache_memory``: how many ran together at most."""
    core = make_engine(loaded, config, disable_hybrid)
    rng = random.Random(config.seed + 1)
    prompts = [
        [rng.randrange(3, config.vocab_size) for _ in range(config.prompt_tokens)]
        for _ in range(config.num_long_requests)
    ]
    _submit(core, prompts, config.memory_output_tokens, "long-")
    most = 0
    start = time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
        most = max(most, len(core.scheduler.running))
    stats = core.stats()
    core.close()
    return {
        "max_running": most,
        "num_preemptions": stats.num_preemptions,
        "num_blocks": core.manager.num_blocks,
        "elapsed_s": time.perf_counter() - start,
    }


def shared_document(
    loaded: LoadedModel, config: HybridBenchConfig, disable_hybrid: bool
) -> tuple[dict[str, float], list[list[int]]]:
    """The document's questions one after another (the first computes the document): hit rate and answers."""
    rng = random.Random(config.seed + 2)
    document = [rng.randrange(3, config.vocab_size) for _ in range(config.document_tokens)]
    questions = [
        document + [rng.randrange(3, config.vocab_size) for _ in range(config.question_tokens)]
        for _ in range(config.num_questions)
    ]
    core = make_engine(loaded, config, disable_hybrid)
    answers: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(questions):
        _submit(core, [prompt], config.answer_tokens, f"q{i}-")
        while core.has_unfinished_requests():
            for output in core.step().outputs:
                answers.setdefault(output.request_id, []).extend(output.new_token_ids)
    stats = core.stats()
    core.close()
    result = {
        "hit_rate": stats.prefix_cache_hit_rate,
        "hits": stats.prefix_cache_hits,
        "queries": stats.prefix_cache_queries,
        "elapsed_s": time.perf_counter() - start,
    }
    return result, [answers[f"q{i}-0"] for i in range(len(questions))]


def run(config: HybridBenchConfig, json_path: Path | None = None) -> dict:
    """Every measurement under both layouts, printed side by side."""
    import torch

    loaded = gemma3_shaped(config)
    report: dict[str, Any] = {
        "config": asdict(config),
        "machine": {"python": platform.python_version(), "processor": platform.machine(), "torch": torch.__version__},
        "kv_cache_groups": [
            [group.sliding_window, len(group.layers)] for group in loaded.config.kv_cache_groups(hybrid=True)
        ],
    }
    answers = {}
    for name, disable in LAYOUTS.items():
        memory = memory_per_request(loaded, config, disable)
        together = concurrency(loaded, config, disable)
        document, answers[name] = shared_document(loaded, config, disable)
        report[name] = {"memory": memory, "concurrency": together, "shared_document": document}
    mask, hybrid = report["mask-only"], report["hybrid"]
    report["hybrid_over_mask_only"] = {
        "decode_bytes": hybrid["memory"]["decode_bytes"] / mask["memory"]["decode_bytes"],
        "peak_bytes": hybrid["memory"]["peak_bytes"] / mask["memory"]["peak_bytes"],
        "max_running": hybrid["concurrency"]["max_running"] / max(1, mask["concurrency"]["max_running"]),
        "hit_rate_equal": hybrid["shared_document"]["hit_rate"] == mask["shared_document"]["hit_rate"],
        "outputs_identical": answers["hybrid"] == answers["mask-only"],
    }
    print(format_report(report))
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def format_report(report: dict) -> str:
    cfg = report["config"]
    ratio = report["hybrid_over_mask_only"]
    sliding = sum(n for window, n in report["kv_cache_groups"] if window)
    lines = [
        f"Gemma-3-shaped random model: {cfg['num_layers']} layers ({sliding} of window {cfg['sliding_window']}), "
        f"hidden {cfg['hidden_size']}, {cfg['num_kv_heads']} KV head(s) of {cfg['head_dim']}; blocks of "
        f"{cfg['block_size']} tokens, prefill chunks of {cfg['max_num_batched_tokens']}; python "
        f"{report['machine']['python']}, torch {report['machine']['torch']}",
        f"{'':<44}{'mask-only':>14}{'hybrid':>14}{'hybrid/mask':>13}",
    ]

    def row(label: str, key: tuple[str, str], scale: float = 1.0, fmt: str = ",.0f", ratio_key: str | None = None):
        values = [report[layout][key[0]][key[1]] / scale for layout in LAYOUTS]
        ratio_text = f"{ratio[ratio_key]:>13.3f}" if ratio_key else f"{'':>13}"
        lines.append(f"{label:<44}{values[0]:>14{fmt}}{values[1]:>14{fmt}}{ratio_text}")

    mib = 2**20
    row(f"KV MiB, one {cfg['prompt_tokens']:,}-token request, decoding", ("memory", "decode_bytes"), mib, ".2f",
        "decode_bytes")  # fmt: skip
    row("KV MiB, same request, peak in prefill", ("memory", "peak_bytes"), mib, ".2f", "peak_bytes")
    row(
        f"requests running at once in {cfg['kv_cache_memory']}", ("concurrency", "max_running"), ratio_key="max_running"
    )
    row("  preemptions", ("concurrency", "num_preemptions"))
    document = f"hit rate, {cfg['document_tokens']:,}-token document x {cfg['num_questions']}"
    row(document, ("shared_document", "hit_rate"), fmt=".4f")
    lines.append(f"hit rates equal: {ratio['hit_rate_equal']}; greedy outputs identical: {ratio['outputs_identical']}")
    return "\n".join(lines)


def register(bench: argparse._SubParsersAction) -> None:
    defaults = HybridBenchConfig()
    p = bench.add_parser(
        "hybrid", help="KV memory, concurrency and hits: hybrid KV cache groups against the mask-only layout",
        description=__doc__,
    )  # fmt: skip
    p.add_argument("--kv-cache-memory", default=defaults.kv_cache_memory, help="the pool of both layouts")
    p.add_argument("--sliding-window", type=positive_int, default=defaults.sliding_window)
    p.add_argument("--prompt-tokens", type=positive_int, default=defaults.prompt_tokens, help="the long requests")
    p.add_argument("--num-long-requests", type=positive_int, default=defaults.num_long_requests)
    p.add_argument("--document-tokens", type=positive_int, default=defaults.document_tokens)
    p.add_argument("--num-questions", type=positive_int, default=defaults.num_questions)
    p.add_argument("--json", type=Path, help="also write the report as JSON here")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> None:
    config = HybridBenchConfig(
        kv_cache_memory=args.kv_cache_memory,
        sliding_window=args.sliding_window,
        prompt_tokens=args.prompt_tokens,
        num_long_requests=args.num_long_requests,
        document_tokens=args.document_tokens,
        num_questions=args.num_questions,
    )
    run(config, args.json)
