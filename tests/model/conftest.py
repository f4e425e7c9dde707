"""Tiny random checkpoints (written with transformers, offline) and a reference for the model tests."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from prefixcache.model import AttentionMetadata, DecoderForCausalLM, KVCacheGroup, StateMetadata
from prefixcache.model import attention as attention_mod
from tests.helpers import write_tiny_checkpoint

VOCAB_SIZE = 512
# Every tiny checkpoint's settings before its own overrides (see tests/helpers.py: write_tiny_checkpoint).
TINY_SETTINGS: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "num_hidden_layers": 3,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.1,
}
GEMMA3_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2

# name -> (transformers model type, config overrides). Weights are random but larger than HF's init, and norm
# weights and biases are randomized too, so that every parameter visibly affects the logits.
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
    # Two full layers, then two with a window of 32 tokens; head_dim is not hidden_size / heads.
    "qwen3_window": (
        "qwen3",
        {
            "num_hidden_layers": 4,
            "head_dim": 24,
            "use_sliding_window": True,
            "sliding_window": 32,
            "max_window_layers": 2,
            "tie_word_embeddings": True,
        },
    ),
    # Two sliding layers (window 32) per full layer, linear RoPE scaling on the full layers only, a
    # query_pre_attn_scalar that is not head_dim, and logit soft-capping.
    "gemma3": (
        "gemma3_text",
        {
            "num_hidden_layers": 6,
            "head_dim": 16,
            "layer_types": GEMMA3_LAYER_TYPES,
            "sliding_window": 32,
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            "final_logit_softcapping": 5.0,
            "tie_word_embeddings": True,
        },
    ),
}


# Hybrids: attention layers between recurrent ones, with state (see tests/model/test_recurrent.py). Heads,
# head sizes and chunk sizes are small and unequal so that a mixed-up dimension fails.
_QWEN3_5_TEXT: dict[str, Any] = {
    "num_hidden_layers": 4,  # three Gated DeltaNet layers, then full attention (the default interval)
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 12,
    "linear_conv_kernel_dim": 4,
}
HYBRID_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_5": ("qwen3_5_text", _QWEN3_5_TEXT | {"tie_word_embeddings": True}),
    "qwen3_5_vl": ("qwen3_5", _QWEN3_5_TEXT),
    "granite_h": (
        "granitemoehybrid",
        {
            "num_hidden_layers": 4,
            "layer_types": ["mamba", "attention", "mamba", "mamba"],
            "num_local_experts": 0,
            "shared_intermediate_size": 96,
            "mamba_n_heads": 4,
            "mamba_d_state": 8,
            "mamba_n_groups": 2,
            "mamba_chunk_size": 16,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.3,
            "logits_scaling": 3.0,
        },
    ),
    "lfm2": (
        "lfm2",
        {
            "num_hidden_layers": 4,
            "layer_types": ["conv", "full_attention", "conv", "conv"],
            "intermediate_size": 144,
            "block_multiple_of": 32,
            "conv_bias": True,
            "tie_word_embeddings": True,
        },
    ),
}


def write_checkpoint(path: Path, kind: str, seed: int = 0) -> Path:
    """Save the tiny model ``kind`` (see TINY_MODELS and HYBRID_MODELS)."""
    model_type, overrides = TINY_MODELS[kind] if kind in TINY_MODELS else HYBRID_MODELS[kind]
    return write_tiny_checkpoint(path, model_type, seed, randomize_norms=True, **(TINY_SETTINGS | overrides))


@pytest.fixture
def torch_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention on torch's path (SDPA over gathered groups) even where prefixcache's prefill kernel runs: for
    tests of the groups themselves, and of the fallback where the kernels are unavailable."""
    monkeypatch.setattr(attention_mod, "_prefill_kernel", lambda: None)


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """All tiny checkpoints, written once per session."""
    root = tmp_path_factory.mktemp("model-ckpts")
    return {kind: write_checkpoint(root / kind, kind) for kind in TINY_MODELS}


@pytest.fixture(scope="session")
def hf_models(checkpoint_dirs: dict[str, Path]) -> dict[str, Any]:
    """The same checkpoints loaded with transformers (float32), the reference implementation."""
    return {kind: load_hf_model(path) for kind, path in checkpoint_dirs.items()}


@pytest.fixture(scope="session")
def hybrid_checkpoint_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny hybrid checkpoints, written once per session."""
    root = tmp_path_factory.mktemp("hybrid-ckpts")
    return {kind: write_checkpoint(root / kind, kind) for kind in HYBRID_MODELS}


@pytest.fixture(scope="session")
def hybrid_hf_models(hybrid_checkpoint_dirs: dict[str, Path]) -> dict[str, Any]:
    """The hybrid checkpoints loaded with transformers (float32)."""
    return {kind: load_hf_model(path) for kind, path in hybrid_checkpoint_dirs.items()}


def load_hf_model(path: Path) -> Any:
    """A tiny checkpoint in transformers' own implementation (float32), as the class it was saved as."""
    import transformers

    architecture = transformers.AutoConfig.from_pretrained(path, local_files_only=True).architectures[0]
    model_class = getattr(transformers, architecture)
    return model_class.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


def assert_matches_transformers(output: Any, hf_model: Any) -> None:
    """Each generated token is HF's argmax after the prompt and the tokens before it, with HF's log-probs."""
    completion = output.outputs[0]
    tokens = output.prompt_token_ids + completion.token_ids
    with torch.no_grad():
        ref = hf_model(torch.tensor([tokens])).logits[0].log_softmax(-1)
    start = len(output.prompt_token_ids) - 1
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        assert token == int(ref[start + i].argmax())
        top = ref[start + i].topk(2)
        assert entry == pytest.approx(dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)), abs=1e-4)


class PagedRunner:
    """A minimal engine: hands out blocks in shuffled order, keeps block tables and runs batched steps.

    ``groups`` are the KV cache groups (default: the mask-only single group); each request has one table per
    group. With ``free_out_of_window`` a sliding group does what the hybrid cache manager does: before each
    step a request's blocks wholly before its window become the null block in its table, and a block no table
    holds any more goes back to the free list for any group to reuse. The null block holds NaN here, so a
    layer gathering any block left of its window would poison the logits.

    For a hybrid (recurrent layers) each request also gets a working state slot, zeroed on its first step;
    ``step`` takes saves (request, tokens of this step) into fresh slots (``saved``), and ``share_prefix``
    starts a request from a saved state, as a checkpoint hit does.
    """

    NULL_BLOCK = 1  # not 0: block tables are padded with 0, and padding may be gathered (masked)

    def __init__(
        self,
        model: DecoderForCausalLM,
        block_size: int,
        num_blocks: int = 96,
        seed: int = 0,
        groups: Sequence[KVCacheGroup] | None = None,
        free_out_of_window: bool = False,
        num_state_slots: int = 16,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.groups = tuple(groups or model.config.kv_cache_groups(hybrid=False))
        self.free_out_of_window = free_out_of_window
        dtype = model.model.norm.weight.dtype  # a float parameter even where the weights are quantized
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size, dtype, "cpu", self.groups)
        self.free = [b for b in range(num_blocks) if b != self.NULL_BLOCK]
        random.Random(seed).shuffle(self.free)
        if free_out_of_window:
            for key_cache, value_cache in self.kv_caches:
                key_cache[self.NULL_BLOCK] = value_cache[self.NULL_BLOCK] = float("nan")
        self.tables: dict[str, list[list[int]]] = {}
        self.computed: dict[str, int] = {}
        self.num_freed = 0
        self.last_metadata: list[AttentionMetadata] = []
        self.state_cache = None
        if model.config.state_layers:
            self.state_cache = model.allocate_state_cache(num_state_slots, dtype, "cpu")
        self.free_slots = list(range(num_state_slots))[::-1]
        self.working_slot: dict[str, int] = {}
        self.saved: dict[tuple[str, int], int] = {}

    def reserve(self, rid: str, num_blocks: int) -> None:
        """Give ``rid`` its first blocks now (in every group), before any step writes them."""
        self.tables[rid] = [[self.free.pop() for _ in range(num_blocks)] for _ in self.groups]

    def share_prefix(self, src: str, dst: str, num_blocks: int, state_slot: int | None = None) -> None:
        """Start ``dst`` with the first blocks of ``src`` (as prefix caching would); they count as computed. A
        hybrid's ``dst`` starts from the state in ``state_slot`` (the state after those blocks)."""
        self.tables[dst] = [table[:num_blocks] for table in self.tables[src]]
        self.computed[dst] = num_blocks * self.block_size
        if self.state_cache is not None:
            assert state_slot is not None, "a hybrid's prefix hit needs the state at its end"
            slot = self.working_slot[dst] = self.free_slots.pop()
            self.model.copy_states(self.state_cache, [state_slot], [slot])

    def step(
        self, batch: list[tuple[str, list[int]]], saves: Sequence[tuple[str, int]] = ()
    ) -> dict[str, torch.Tensor]:
        """Run one step with the given new tokens per request; returns each request's logits [new, vocab].

        ``saves``: (request, n) leaves its state after its first n new tokens in ``saved[(request, n)]``."""
        computed, new, ids = [], [], []
        for rid, tokens in batch:
            tables = self.tables.setdefault(rid, [[] for _ in self.groups])
            done = self.computed.setdefault(rid, 0)
            for table in tables:
                while len(table) * self.block_size < done + len(tokens):
                    table.append(self.free.pop())
            computed.append(done)
            new.append(len(tokens))
            ids.extend(tokens)
        if self.free_out_of_window:
            self._free_blocks_left_of_the_windows()
        self.last_metadata = [
            AttentionMetadata.build(
                [self.tables[rid][g] for rid, _ in batch], computed, new, self.block_size, "cpu", group.sliding_window
            )
            for g, group in enumerate(self.groups)
        ]
        meta = self.last_metadata[0]
        state_metadata = self._state_metadata(batch, new, saves)
        hidden = self.model(
            torch.tensor(ids), meta.positions, self.kv_caches, self.last_metadata, self.state_cache, state_metadata
        )
        logits = self.model.compute_logits(hidden).float()  # the model's dtype: compared as float32
        out = {}
        for r, (rid, tokens) in enumerate(batch):
            start = int(meta.query_start_loc[r])
            out[rid] = logits[start : start + len(tokens)]
            self.computed[rid] += len(tokens)
        return out

    def _state_metadata(
        self, batch: list[tuple[str, list[int]]], new: list[int], saves: Sequence[tuple[str, int]]
    ) -> StateMetadata | None:
        if self.state_cache is None:
            return None
        fresh = [rid for rid, _ in batch if rid not in self.working_slot]
        for rid in fresh:
            self.working_slot[rid] = self.free_slots.pop()
        self.model.zero_states(self.state_cache, [self.working_slot[rid] for rid in fresh])
        rows = {rid: row for row, (rid, _) in enumerate(batch)}
        save_rows = []
        for rid, n in saves:
            self.saved[(rid, n)] = slot = self.free_slots.pop()
            save_rows.append((rows[rid], n, slot))
        return StateMetadata.build([self.working_slot[rid] for rid, _ in batch], new, save_rows, "cpu")

    def _free_blocks_left_of_the_windows(self) -> None:
        for g, group in enumerate(self.groups):
            if group.sliding_window is None:
                continue
            for rid, tables in self.tables.items():
                first_visible = self.computed.get(rid, 0) - group.sliding_window + 1
                for i in range(max(first_visible, 0) // self.block_size):
                    tables[g][i] = self.NULL_BLOCK
        in_use = {block for tables in self.tables.values() for table in tables for block in table}
        left = set(range(len(self.kv_caches[0][0]))) - set(self.free) - in_use - {self.NULL_BLOCK}
        self.free.extend(sorted(left))
        self.num_freed += len(left)
