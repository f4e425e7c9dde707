"""``prefixcache::gguf_decode_layer_`` (native/decode_layer.cpp): an eager decode step runs each layer of a GGUF
model in one call, with the same results as the layer's modules, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixcache.model import load_model
from prefixcache.model.decoder import DecoderLayer
from prefixcache.model.quantization import gguf_ops
from tests.helpers import build_tokenizer, write_tiny_checkpoint
from tests.model.test_decoder import decode_logits
from tests.model.test_loader import write_gguf
from tests.model.test_quantization import PROMPTS, tiny_gguf

# requests of the tiny GGUF's vocabulary, one longer than a block
DECODING = dict(zip("abcd", PROMPTS, strict=True))

if gguf_ops() is None:
    pytest.skip("prefixcache's GGUF kernels are unavailable (no compiler, or no AVX-512 VNNI)", allow_module_level=True)


def packed_layer_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at each layer a step runs as one ``gguf_decode_layer_`` call."""
    calls: list[int] = []
    original = DecoderLayer._packed_decode_forward
    monkeypatch.setattr(
        DecoderLayer, "_packed_decode_forward", lambda self, *inputs: calls.append(1) or original(self, *inputs)
    )
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("weight_type", ["Q4_1", "Q8_0"])
def test_a_packed_decode_step_equals_the_layers_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weight_type: str, dtype: str
) -> None:
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    model = load_model(tiny_gguf(tmp_path, weight_type), dtype=dtype, quantized=True).model
    layers = model.model.layers
    assert all(layer.packed_decode is not None for layer in layers)
    calls = packed_layer_calls(monkeypatch)
    packed = decode_logits(model, prompts=DECODING)
    assert len(calls) == 3 * len(layers)  # each layer of the 3 decode steps (the prefill runs the modules)
    for layer in layers:
        monkeypatch.setattr(layer, "packed_decode", None)
    modules = decode_logits(model, prompts=DECODING)
    assert len(calls) == 3 * len(layers)
    for ours, theirs in zip(packed, modules, strict=True):
        assert ours.keys() == theirs.keys()
        for rid in ours:
            assert torch.equal(ours[rid], theirs[rid])


def test_layers_it_does_not_compute_keep_their_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3 norms each head's query and key inside attention, which the op does not: its layers get no packed
    decode, and decode through their modules."""
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    settings = dict(vocab_size=len(build_tokenizer()), initializer_range=0.05, tie_word_embeddings=True)
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", "qwen3", **settings)
    model = load_model(write_gguf(checkpoint, tmp_path / "qwen3.gguf", "Q4_1"), quantized=True).model
    assert all(layer.packed_decode is None for layer in model.model.layers)
    calls = packed_layer_calls(monkeypatch)
    decode_logits(model, prompts=DECODING)
    assert calls == []


def test_weights_that_are_not_packed_tiles_are_refused_before_anything_is_written() -> None:
    hidden, heads, kv_heads, head_dim = 64, 4, 2, 16
    x, residual = torch.randn(1, hidden), torch.randn(1, hidden)
    before = (x.clone(), residual.clone())
    norm = torch.ones(hidden)
    k_cache = torch.zeros(4, 4, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    rope = torch.ones(1, 1, head_dim)
    dense = torch.zeros(hidden, hidden, dtype=torch.uint8)  # a 2-D byte matrix, not tiles
    with pytest.raises(RuntimeError, match="weights must be packed GGUF tiles"):
        torch.ops.prefixcache.gguf_decode_layer_(
            x, residual, False, norm, norm, 1e-6, False, [dense] * 4, [128, 64, 256, 64], heads, kv_heads,
            k_cache, v_cache, torch.tensor([0]), rope, rope, torch.tensor([[0]]), torch.tensor([1]), 0.25, None,
        )  # fmt: skip
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])
