"""Tiny random checkpoints (written with transformers, offline) and a reference for the model tests."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from prefixcache.model import AttentionMetadata, DecoderForCausalLM

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 320

# name -> (HF architecture, config overrides). Weights are random but larger than HF's init, and norm weights
# and biases are randomized too, so that every parameter visibly affects the logits.
TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama_bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "llama3_rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 50000.0,
        },
    ),
    "linear_rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "mistral_window": ("mistral", {"sliding_window": 8, "head_dim": 16}),
}


def build_tokenizer() -> Any:
    """A byte-level BPE tokenizer without merges (any text round-trips) with ChatML specials and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def write_checkpoint(path: Path, kind: str, seed: int = 0) -> Path:
    """Save the tiny model ``kind`` (see TINY_MODELS) with random weights and the tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides = TINY_MODELS[kind]
    tokenizer = build_tokenizer()
    settings: dict[str, Any] = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.1,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
        "tie_word_embeddings": False,
        **overrides,
    }
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """All tiny checkpoints, written once per session."""
    root = tmp_path_factory.mktemp("model-ckpts")
    return {kind: write_checkpoint(root / kind, kind) for kind in TINY_MODELS}


@pytest.fixture(scope="session")
def hf_models(checkpoint_dirs: dict[str, Path]) -> dict[str, Any]:
    """The same checkpoints loaded with transformers (float32), the reference implementation."""
    from transformers import AutoModelForCausalLM

    return {
        kind: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
        for kind, path in checkpoint_dirs.items()
    }


class PagedRunner:
    """A minimal engine: hands out blocks in shuffled order, keeps block tables and runs batched steps."""

    def __init__(self, model: DecoderForCausalLM, block_size: int, num_blocks: int = 96, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        dtype = model.model.embed_tokens.weight.dtype
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size, dtype, "cpu")
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def share_prefix(self, src: str, dst: str, num_blocks: int) -> None:
        """Start ``dst`` with the first blocks of ``src`` (as prefix caching would); they count as computed."""
        self.tables[dst] = self.tables[src][:num_blocks]
        self.computed[dst] = num_blocks * self.block_size

    def step(self, batch: list[tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
        """Run one step with the given new tokens per request; returns each request's logits [new, vocab]."""
        tables, computed, new, ids = [], [], [], []
        for rid, tokens in batch:
            table = self.tables.setdefault(rid, [])
            done = self.computed.setdefault(rid, 0)
            while len(table) * self.block_size < done + len(tokens):
                table.append(self.free.pop())
            tables.append(table)
            computed.append(done)
            new.append(len(tokens))
            ids.extend(tokens)
        meta = AttentionMetadata.build(tables, computed, new, self.block_size, "cpu")
        hidden = self.model(torch.tensor(ids), meta.positions, self.kv_caches, meta)
        logits = self.model.compute_logits(hidden)
        out = {}
        for r, (rid, tokens) in enumerate(batch):
            start = int(meta.query_start_loc[r])
            out[rid] = logits[start : start + len(tokens)]
            self.computed[rid] += len(tokens)
        return out
