"""Linear layers on weights laid out once for the CPU's kernel (``prefixcache.model.cpu_linear``): in bfloat16 on
oneDNN's packed layout, the same products as torch's ``F.linear`` bit for bit; in float32 on the transposed weight,
the same products within float32's rounding; on every linear layer of an eager engine of that dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.engine import LLM, SamplingParams
from prefixcache.model import decoder as decoder_mod
from prefixcache.model import load_model
from prefixcache.model.cpu_linear import OneDNNLinear, TransposedLinear, linear_layout, pack_linears
from prefixcache.model.quantization import module_bytes
from tests.helpers import write_tiny_checkpoint

needs_amx = pytest.mark.skipif(
    linear_layout(torch.bfloat16, "cpu") is not OneDNNLinear,
    reason="oneDNN's packed bfloat16 layout is used on CPUs with AMX tiles",
)
needs_mkl = pytest.mark.skipif(
    linear_layout(torch.float32, "cpu") is not TransposedLinear, reason="the transposed float32 layout is MKL's"
)


@needs_amx
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_multiplies_as_torch_does(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    packed = OneDNNLinear(linear.weight, linear.bias)
    assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))
    assert torch.equal(packed(x.view(1, rows, 96)), F.linear(x, linear.weight, linear.bias).view(1, rows, 200))
    # the packed layout pads the output rows to its blocking (here 200 to 224): counted as it is held
    assert module_bytes(linear) <= module_bytes(packed) <= 1.15 * module_bytes(linear)


@needs_mkl
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_a_transposed_linear_multiplies_as_torch_does(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96, generator=gen)
    transposed = TransposedLinear(linear.weight, linear.bias)
    torch.testing.assert_close(transposed(x), F.linear(x, linear.weight, linear.bias))
    assert transposed(x.view(1, rows, 96)).shape == (1, rows, 200)
    assert torch.equal(transposed(x.view(1, rows, 96)).view(rows, 200), transposed(x))
    assert module_bytes(transposed) == module_bytes(linear)


@pytest.mark.parametrize(
    ("layout", "dtype"),
    [pytest.param(OneDNNLinear, torch.bfloat16, marks=needs_amx), (TransposedLinear, torch.float32)],
)
def test_only_the_layouts_dtype_is_packed(layout: type[nn.Module], dtype: torch.dtype) -> None:
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    model = nn.Sequential(nn.Linear(8, 8).to(dtype), nn.Sequential(nn.Linear(8, 8).to(other)), nn.ReLU())
    assert pack_linears(model, layout) == 1
    assert type(model[0]) is layout and type(model[1][0]) is nn.Linear


def greedy(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Tokens and log-probabilities of fixed prompts, greedily."""
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
    outputs = llm.generate([[5, 6, 7, 8, 9] * 7, [11, 3, 2]], params)
    return [(o.outputs[0].token_ids, [dict(p) for p in o.outputs[0].logprobs]) for o in outputs]


def engine_greedy(model_dir, dtype: str, laid_out: bool, monkeypatch: pytest.MonkeyPatch):
    """``greedy`` of an eager engine with the CPU layouts on or off, and the types of its linear layers."""
    layout = linear_layout(getattr(torch, dtype), "cpu")
    monkeypatch.setattr(decoder_mod, "linear_layout", lambda dtype, device: layout if laid_out else None)
    loaded = load_model(str(model_dir), dtype=dtype)
    llm = LLM(str(model_dir), loaded=loaded, dtype=dtype, num_blocks=64, block_size=4)
    try:
        kinds = {type(m) for m in loaded.model.modules() if isinstance(m, nn.Linear | OneDNNLinear | TransposedLinear)}
        return greedy(llm), kinds
    finally:
        llm.engine.close()


def plain_and_laid_out(model_dir, dtype: str, layout: type[nn.Module], monkeypatch: pytest.MonkeyPatch):
    """``greedy`` with torch's linear layers and with every one of them as ``layout``."""
    plain, plain_kinds = engine_greedy(model_dir, dtype, False, monkeypatch)
    laid_out, laid_out_kinds = engine_greedy(model_dir, dtype, True, monkeypatch)
    assert (plain_kinds, laid_out_kinds) == ({nn.Linear}, {layout})
    return plain, laid_out


@needs_amx
def test_an_eager_bfloat16_engine_packs_every_linear_and_decodes_the_same(
    tiny_llama_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same tokens and log-probabilities bit for bit as with torch's linear layers (packing switched off)."""
    plain, packed = plain_and_laid_out(tiny_llama_dir, "bfloat16", OneDNNLinear, monkeypatch)
    assert packed == plain


@needs_mkl
def test_an_eager_float32_engine_transposes_every_linear_and_decodes_alike(
    tiny_llama_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same greedy tokens as with torch's linear layers, log-probabilities within float32's rounding."""
    plain, laid_out = plain_and_laid_out(tiny_llama_dir, "float32", TransposedLinear, monkeypatch)
    assert [tokens for tokens, _ in laid_out] == [tokens for tokens, _ in plain]
    for (_, got), (_, expected) in zip(laid_out, plain, strict=True):
        for got_step, expected_step in zip(got, expected, strict=True):
            assert got_step.keys() == expected_step.keys()
            for token, logprob in got_step.items():
                assert logprob == pytest.approx(expected_step[token], abs=1e-4)


@needs_amx
def test_a_tied_output_projection_gets_a_packed_copy_in_bfloat16(tmp_path) -> None:
    """The embedding keeps its rows for lookups; the logits are the products with them."""
    model = load_model(str(write_tiny_checkpoint(tmp_path, tie_word_embeddings=True)), dtype="bfloat16").model
    assert model.lm_head is None
    hidden = torch.randn(3, model.config.hidden_size).to(torch.bfloat16)
    expected = model.compute_logits(hidden)
    assert model.pack_linears() > 0
    assert type(model.lm_head) is OneDNNLinear and type(model.model.embed_tokens) is nn.Embedding
    assert torch.equal(model.compute_logits(hidden), expected)


@needs_mkl
def test_a_tied_output_projection_keeps_the_embeddings_rows_in_float32(tmp_path) -> None:
    """No transposed copy of the vocabulary's matrix (its size again, 0.79x at 128 rows): the logits are unchanged."""
    model = load_model(str(write_tiny_checkpoint(tmp_path, tie_word_embeddings=True)), dtype="float32").model
    hidden = torch.randn(3, model.config.hidden_size)
    expected = model.compute_logits(hidden)
    assert model.pack_linears() > 0
    assert model.lm_head is None and type(model.model.embed_tokens) is nn.Embedding
    assert torch.equal(model.compute_logits(hidden), expected)
