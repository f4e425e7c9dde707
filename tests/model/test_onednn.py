"""bfloat16 linear layers on oneDNN's packed layout (``prefixcache.model.onednn``): the same products as torch's
``F.linear`` bit for bit, on every linear layer of an eager bfloat16 engine on a CPU with AMX tiles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prefixcache.engine import LLM, SamplingParams
from prefixcache.model import load_model
from prefixcache.model import onednn as onednn_mod
from prefixcache.model.onednn import OneDNNLinear, pack_linears, packs_linears
from prefixcache.model.quantization import module_bytes
from tests.helpers import write_tiny_checkpoint

pytestmark = pytest.mark.skipif(
    not packs_linears(torch.bfloat16, "cpu"), reason="oneDNN's packed bfloat16 layout is used on CPUs with AMX tiles"
)


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


def test_only_bfloat16_linears_are_packed() -> None:
    model = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16), nn.Sequential(nn.Linear(8, 8)), nn.ReLU())
    assert pack_linears(model) == 1
    assert type(model[0]) is OneDNNLinear and type(model[1][0]) is nn.Linear


def greedy(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Tokens and log-probabilities of fixed prompts, greedily."""
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
    outputs = llm.generate([[5, 6, 7, 8, 9] * 7, [11, 3, 2]], params)
    return [(o.outputs[0].token_ids, [dict(p) for p in o.outputs[0].logprobs]) for o in outputs]


def test_an_eager_bfloat16_engine_packs_every_linear_and_decodes_the_same(
    tiny_llama_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same tokens and log-probabilities bit for bit as with torch's linear layers (packing switched off)."""
    outputs = {}
    for packing in (False, True):
        monkeypatch.setattr(onednn_mod, "amx_tiles", lambda packing=packing: packing)
        loaded = load_model(str(tiny_llama_dir), dtype="bfloat16")
        llm = LLM(str(tiny_llama_dir), loaded=loaded, dtype="bfloat16", num_blocks=64, block_size=4)
        try:
            linears = [m for m in loaded.model.modules() if isinstance(m, nn.Linear | OneDNNLinear)]
            assert {type(m) for m in linears} == {OneDNNLinear if packing else nn.Linear}
            outputs[packing] = greedy(llm)
        finally:
            llm.engine.close()
    assert outputs[True] == outputs[False]


def test_a_tied_output_projection_gets_a_packed_copy(tmp_path) -> None:
    """The embedding keeps its rows for lookups; the logits are the products with them."""
    model = load_model(str(write_tiny_checkpoint(tmp_path, tie_word_embeddings=True)), dtype="bfloat16").model
    assert model.lm_head is None
    hidden = torch.randn(3, model.config.hidden_size).to(torch.bfloat16)
    expected = model.compute_logits(hidden)
    assert model.pack_linears() > 0
    assert type(model.lm_head) is OneDNNLinear and type(model.model.embed_tokens) is nn.Embedding
    assert torch.equal(model.compute_logits(hidden), expected)
