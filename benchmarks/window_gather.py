"""Prefill and decode speed of a Gemma-3-shaped random model: sliding layers that gather only their window
(the hybrid KV cache layout) against the mask-only layout (every layer gathers every block, sliding layers
mask), measured alternately in one process. Random weights: only the amount of work matters, so the rates
are tokens per second of this process's CPU time on one thread (a busy machine slows the wall clock, not
this).

    PYTHONPATH=src .venv/bin/python benchmarks/window_gather.py [--tokens 4096] [--window 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
from alternating import compare_alternately

from prefixcache.argtypes import positive_int
from prefixcache.model import AttentionMetadata, DecoderForCausalLM, KVCacheGroup, ModelConfig


def gemma3_shaped(window: int, max_len: int) -> ModelConfig:
    """Gemma 3 1B's attention shape (4 query heads, 1 KV head of 256, window 512, 5 sliding per full layer),
    narrower elsewhere, over 6 layers."""
    return ModelConfig(
        vocab_size=1024,
        hidden_size=512,
        num_layers=6,
        num_heads=4,
        num_kv_heads=1,
        head_dim=256,
        intermediate_size=1024,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        architecture="Gemma3ForCausalLM",
        sliding_window=window,
        layer_types=("sliding_attention",) * 5 + ("full_attention",),
        hidden_act="gelu_pytorch_tanh",
        qk_norm=True,
        norm_unit_offset=True,
        sandwich_norm=True,
        embed_scale=512**0.5,
        query_pre_attn_scalar=256,
        sliding_rope_theta=1e4,
    )


class Layout:
    """One request's block tables in a layout, and the step that runs chunks of its tokens."""

    def __init__(self, model: DecoderForCausalLM, groups: tuple[KVCacheGroup, ...], tokens: int, block_size: int):
        self.model, self.groups, self.block_size = model, groups, block_size
        per_group = -(-tokens // block_size) + 1
        self.tables = [list(range(g * per_group, (g + 1) * per_group)) for g in range(len(groups))]
        self.kv_caches = model.allocate_kv_cache(per_group * len(groups), block_size, torch.float32, "cpu", groups)

    def step(self, token_ids: list[list[int]], computed: list[int]) -> None:
        tables = [[table] * len(token_ids) for table in self.tables]  # requests reading the same blocks
        new = [len(t) for t in token_ids]
        metadata = [
            AttentionMetadata.build(tables[g], computed, new, self.block_size, "cpu", group.sliding_window)
            for g, group in enumerate(self.groups)
        ]
        ids = torch.tensor([t for seq in token_ids for t in seq])
        self.model(ids, metadata[0].positions, self.kv_caches, metadata)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=positive_int, default=4096)
    parser.add_argument("--window", type=positive_int, default=512)
    parser.add_argument("--chunk", type=positive_int, default=1024, help="prefill chunk size of the chunked case")
    parser.add_argument("--decodes", type=positive_int, default=8, help="requests in the decode batch")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--repeats", type=positive_int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = gemma3_shaped(args.window, args.tokens + 1)
    model = DecoderForCausalLM(config).requires_grad_(False).eval()
    layouts = {
        "mask-only": Layout(model, config.kv_cache_groups(hybrid=False), args.tokens + 1, args.block_size),
        "window gather": Layout(model, config.kv_cache_groups(hybrid=True), args.tokens + 1, args.block_size),
    }
    prompt = torch.randint(0, config.vocab_size, (args.tokens + 1,)).tolist()
    chunks = range(0, args.tokens, args.chunk)
    cases = {
        f"fresh prefill of {args.tokens}": (
            args.tokens,
            lambda layout: layout.step([prompt[: args.tokens]], [0]),
        ),
        f"prefill in chunks of {args.chunk}": (
            args.tokens,
            lambda layout: [layout.step([prompt[s : s + args.chunk]], [s]) for s in chunks],
        ),
        f"{args.decodes} decodes at {args.tokens}": (
            args.decodes,
            lambda layout: layout.step([prompt[args.tokens :]] * args.decodes, [args.tokens] * args.decodes),
        ),
    }
    report: dict = {"config": vars(args), "machine": {"cpu": platform.processor() or platform.machine(), "threads": 1}}
    report.update(compare_alternately(cases, layouts, args.repeats, ("speedup", "window gather", "mask-only")))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
