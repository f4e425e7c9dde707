"""Prefill and decode speed of a Qwen3.5-shaped hybrid (three Gated DeltaNet layers per gated full-attention
layer) against a full-attention model of the same hidden size, heads and layer count, measured alternately in
one process. Random weights: only the amount of work matters, so the rates are tokens per second of this
process's CPU time on one thread (a busy machine slows the wall clock, not this).

    PYTHONPATH=src .venv/bin/python benchmarks/recurrent_speed.py [--tokens 2048] [--layers 8] [--repeats 3]

Issue 24's goal: the hybrid's prefill at least 0.5x the full-attention model's, its decode at least 0.8x.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
from alternating import compare_alternately

from prefixcache.argtypes import positive_int
from prefixcache.model import AttentionMetadata, DecoderForCausalLM, ModelConfig, StateMetadata
from prefixcache.model.config import GatedDeltaNetSpec


def qwen3_5_shaped(num_layers: int, hybrid: bool, max_len: int) -> ModelConfig:
    """Qwen3.5-0.8B's widths (hidden 1024, 8 query and 2 KV heads of 256, 16 linear heads of 128, MLP 3584)
    over ``num_layers`` layers: every fourth full attention when ``hybrid``, else all of them."""
    kinds = ["full_attention" if not hybrid or (i + 1) % 4 == 0 else "gated_delta_net" for i in range(num_layers)]
    return ModelConfig(
        vocab_size=4096,
        hidden_size=1024,
        num_layers=num_layers,
        num_heads=8,
        num_kv_heads=2,
        head_dim=256,
        intermediate_size=3584,
        rms_norm_eps=1e-6,
        rope_theta=1e7,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        architecture="Qwen3_5ForCausalLM",
        layer_types=tuple(kinds),
        qk_norm=True,
        norm_unit_offset=True,
        partial_rotary_factor=0.25,
        attention_output_gate=True,
        gated_delta_net=GatedDeltaNetSpec(num_k_heads=16, num_v_heads=16, head_k_dim=128, head_v_dim=128, conv_kernel=4)
        if hybrid
        else None,
    )


class Runner:
    """``num_requests`` requests over the same block table (and, for the hybrid, a state slot each)."""

    def __init__(self, model: DecoderForCausalLM, tokens: int, block_size: int, num_requests: int) -> None:
        self.model, self.block_size = model, block_size
        num_blocks = -(-tokens // block_size) + 1
        self.table = list(range(num_blocks))
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size, torch.float32, "cpu")
        self.state_cache = None
        if model.config.state_layers:
            self.state_cache = model.allocate_state_cache(2 * num_requests + 1, torch.float32, "cpu")

    def step(self, token_ids: list[list[int]], computed: list[int], save_every: int | None = None) -> None:
        new = [len(t) for t in token_ids]
        attention = AttentionMetadata.build([self.table] * len(token_ids), computed, new, self.block_size, "cpu")
        state = None
        if self.state_cache is not None:
            slots = list(range(len(token_ids)))
            saves = []
            if save_every is not None:  # checkpoints of the first request's state, into the spare slots
                saves = [(0, n, len(slots) + i) for i, n in enumerate(range(save_every, new[0] + 1, save_every))]
            state = StateMetadata.build(slots, new, saves[: len(self.state_cache[0][0]) - len(slots)], "cpu")
        ids = torch.tensor([t for seq in token_ids for t in seq])
        self.model(ids, attention.positions, self.kv_caches, [attention], self.state_cache, state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=positive_int, default=2048)
    parser.add_argument("--layers", type=positive_int, default=8)
    parser.add_argument("--chunk", type=positive_int, default=512, help="prefill chunk size of the chunked case")
    parser.add_argument("--save-every", type=positive_int, default=256, help="tokens between saved states")
    parser.add_argument("--decodes", type=positive_int, default=8, help="requests in the decode batch")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--repeats", type=positive_int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    models = {
        "full attention": DecoderForCausalLM(qwen3_5_shaped(args.layers, False, args.tokens + 1)),
        "qwen3.5 hybrid": DecoderForCausalLM(qwen3_5_shaped(args.layers, True, args.tokens + 1)),
    }
    runners = {
        name: Runner(model.requires_grad_(False).eval(), args.tokens + 1, args.block_size, args.decodes)
        for name, model in models.items()
    }
    prompt = torch.randint(0, 4096, (args.tokens + 1,)).tolist()
    chunks = range(0, args.tokens, args.chunk)
    cases = {
        f"fresh prefill of {args.tokens}": (args.tokens, lambda r: r.step([prompt[: args.tokens]], [0])),
        f"prefill in chunks of {args.chunk}": (
            args.tokens,
            lambda r: [r.step([prompt[s : s + args.chunk]], [s]) for s in chunks],
        ),
        f"prefill of {args.tokens} saving a state every {args.save_every}": (
            args.tokens,
            lambda r: r.step([prompt[: args.tokens]], [0], save_every=args.save_every),
        ),
        f"{args.decodes} decodes at {args.tokens}": (
            args.decodes,
            lambda r: r.step([prompt[args.tokens :]] * args.decodes, [args.tokens] * args.decodes),
        ),
    }
    report: dict = {
        "config": vars(args),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": 1},
        "state_bytes_per_slot": models["qwen3.5 hybrid"].state_bytes_per_slot(torch.float32),
    }
    report.update(compare_alternately(cases, runners, args.repeats, ("ratio", "qwen3.5 hybrid", "full attention")))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
