"""The hybrid models (Qwen3.5, Granite 4.0-H, LFM2) reproduce transformers' logits however a sequence is split
into steps, batched with others, or resumed from a state saved inside a chunk (what a checkpoint hit does)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from prefixcache.model import DecoderForCausalLM, ModelConfig, StateMetadata, load_model
from prefixcache.model.recurrent import (
    decayed_linear_attention_chunked,
    decayed_linear_attention_step,
    gated_delta_rule_chunked,
    gated_delta_rule_step,
)
from tests.model.conftest import HYBRID_MODELS, PagedRunner, load_hf_model
from tests.model.test_decoder import ATOL, hf_logits, random_tokens

KINDS = list(HYBRID_MODELS)
BLOCK = 16


@pytest.fixture(scope="module")
def models(hybrid_checkpoint_dirs: dict[str, Path]) -> dict[str, DecoderForCausalLM]:
    """Each hybrid as our loader loads it (float32)."""
    return {kind: load_model(path).model for kind, path in hybrid_checkpoint_dirs.items()}


@pytest.fixture(scope="module")
def models64(hybrid_checkpoint_dirs: dict[str, Path]) -> dict[str, DecoderForCausalLM]:
    """The same in float64: the state tests compare runs of one model split differently, exactly."""
    return {kind: load_model(path).model.double() for kind, path in hybrid_checkpoint_dirs.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_cold_prompt_matches_transformers(kind: str, models, hybrid_hf_models) -> None:
    """A whole prompt in one step is as close to transformers' float64 logits as transformers' own float32.

    A fixed float32 tolerance does not fit: on random weights the chunked delta rule's triangular solves
    amplify rounding, and transformers' float32 Qwen3.5 is up to 6e-4 from its float64 (Granite and LFM2 are
    within 1e-5). A wrong state or a mixed-up dimension moves logits by 0.1 and more.
    """
    tokens = random_tokens(150, seed=1)  # more than two Gated DeltaNet chunks and nine Mamba2 chunks
    ours = PagedRunner(models[kind], BLOCK).step([("a", tokens)])["a"]
    hf_model = hybrid_hf_models[kind]
    with torch.no_grad():
        truth = copy.deepcopy(hf_model).double()(torch.tensor([tokens])).logits[0]
    hf_error = (hf_logits(hf_model, tokens) - truth).abs().max().item()
    our_error = (ours.double() - truth).abs().max().item()
    assert our_error <= max(2 * hf_error, ATOL), f"{our_error:.1e} from float64; transformers' float32 {hf_error:.1e}"


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_as_close_as_transformers(kind: str, hybrid_checkpoint_dirs, hybrid_hf_models) -> None:
    """In bfloat16 (conv windows in bfloat16, matrix states in float32) a prompt and its decode are about as far
    from float32 as transformers' own bfloat16 is."""
    path = hybrid_checkpoint_dirs[kind]
    runner = PagedRunner(load_model(path, dtype="bfloat16").model, BLOCK)
    tokens = random_tokens(70, seed=6)
    ours = torch.cat([runner.step([("a", tokens[:68])])["a"], *(runner.step([("a", [t])])["a"] for t in tokens[68:])])
    expected = hf_logits(hybrid_hf_models[kind], tokens)
    hf_error = (hf_logits(load_hf_model(path).to(torch.bfloat16), tokens) - expected).abs().max()
    assert (ours - expected).abs().max() <= max(1.5 * hf_error, 0.03 * expected.abs().max())


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_equal_transformers_generate(kind: str, models, hybrid_hf_models) -> None:
    """Prefill, then one-token decode steps from the state slot: the greedy tokens transformers' ``generate``
    (its own cache and one-step recurrences) picks."""
    prompt = random_tokens(40, seed=7)
    with torch.no_grad():
        expected = hybrid_hf_models[kind].generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    runner = PagedRunner(models[kind], BLOCK)
    logits = runner.step([("a", prompt)])["a"]
    generated = []
    for _ in range(12):
        generated.append(int(logits[-1].argmax()))
        logits = runner.step([("a", generated[-1:])])["a"]
    assert generated == expected[0, len(prompt) :].tolist()


def cold_logits(model: DecoderForCausalLM, tokens: list[int]) -> torch.Tensor:
    """The logits of ``tokens`` run from a zeroed state in one step."""
    return PagedRunner(model, BLOCK).step([("cold", tokens)])["cold"]


def assert_as_cold(ours: torch.Tensor, model: DecoderForCausalLM, tokens: list[int], start: int) -> None:
    """Our logits for tokens[start:] equal the cold one-step run's at those positions: to float32 rounding, as
    the norms and logits are float32 even in a float64 model (a wrong state moves logits by 1e-2 and more)."""
    torch.testing.assert_close(ours, cold_logits(model, tokens)[start:], atol=1e-5, rtol=1e-5)


def test_configs_read_from_transformers(models) -> None:
    """The recurrent layers are state layers, in no KV cache group; the attention layers' groups stay."""
    qwen, granite, lfm2 = models["qwen3_5"].config, models["granite_h"].config, models["lfm2"].config
    assert qwen.layer_types == ("gated_delta_net",) * 3 + ("full_attention",)
    assert (qwen.state_layers, qwen.attention_layers, qwen.rotary_dim) == ((0, 1, 2), (3,), 4)
    assert models["qwen3_5_vl"].config.layer_types == qwen.layer_types
    assert [g.layers for g in qwen.kv_cache_groups()] == [(3,)]
    assert (granite.state_layers, granite.use_rope, granite.attention_scale) == ((0, 2, 3), False, 0.3)
    assert (lfm2.state_layers, [g.layers for g in lfm2.kv_cache_groups(hybrid=False)]) == ((0, 2, 3), [(1,)])
    assert lfm2.intermediate_size == 96  # 144 * 2 / 3, a multiple of block_multiple_of=32


def test_granite_with_experts_is_refused() -> None:
    hf_config = AutoConfig.for_model(
        "granitemoehybrid", num_hidden_layers=2, layer_types=["mamba", "attention"], num_local_experts=4
    )
    with pytest.raises(ValueError, match=r"num_local_experts=4\) is not supported; only dense"):
        ModelConfig.from_hf_config(hf_config)


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_in_chunks_through_the_state_slot(kind: str, models64) -> None:
    """Chunks of any size, single tokens among them, continue the state exactly."""
    model = models64[kind]
    tokens = random_tokens(120, seed=2)
    runner = PagedRunner(model, BLOCK)
    pieces, pos = [], 0
    for size in (70, 1, 2, 30, 1, 16):
        pieces.append(runner.step([("a", tokens[pos : pos + size])])["a"])
        pos += size
    assert_as_cold(torch.cat(pieces), model, tokens, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_state_saved_mid_chunk_resumes_another_request(kind: str, models64) -> None:
    """A state saved at block boundaries inside a chunk, restored into a fresh slot with the shared blocks,
    continues another prompt exactly as its cold run (a checkpoint hit), then decodes on."""
    prefix = random_tokens(3 * BLOCK, seed=3)
    a_tokens = [*prefix, *random_tokens(21, seed=4)]
    b_tokens = [*prefix[: 2 * BLOCK], *random_tokens(25, seed=5)]
    model = models64[kind]
    runner = PagedRunner(model, BLOCK)
    out_a = runner.step([("a", a_tokens)], saves=[("a", 2 * BLOCK), ("a", 3 * BLOCK)])
    assert_as_cold(out_a["a"], model, a_tokens, 0)  # saving leaves the run itself unchanged

    runner.share_prefix("a", "b", num_blocks=2, state_slot=runner.saved[("a", 2 * BLOCK)])
    out_b = runner.step([("b", b_tokens[2 * BLOCK :])])
    assert_as_cold(out_b["b"], model, b_tokens, 2 * BLOCK)
    b_tokens.append(7)
    assert_as_cold(runner.step([("b", [7])])["b"], model, b_tokens, len(b_tokens) - 1)

    runner.share_prefix("a", "c", num_blocks=3, state_slot=runner.saved[("a", 3 * BLOCK)])
    c_tokens = [*prefix, 9]
    assert_as_cold(runner.step([("c", [9])])["c"], model, c_tokens, len(prefix))


@pytest.mark.parametrize("kind", KINDS)
def test_batched_decode_equals_each_alone(kind: str, models64) -> None:
    """Requests in different slots decode as one batch, beside a prefill that saves a state, as each alone."""
    seqs = {rid: random_tokens(n + 3, seed=40 + i) for i, (rid, n) in enumerate([("x", 37), ("y", 5), ("z", 80)])}
    model = models64[kind]
    runner = PagedRunner(model, BLOCK)
    runner.step([("x", seqs["x"][:37]), ("y", seqs["y"][:5])])
    outs: dict[str, list[torch.Tensor]] = {"x": [], "y": []}
    for extra in range(3):
        batch = [("y", [seqs["y"][5 + extra]]), ("x", [seqs["x"][37 + extra]])]
        saves = [("x", 1)] if extra == 1 else []
        if extra == 1:
            batch.append(("z", seqs["z"][:80]))
            saves.append(("z", 3 * BLOCK))
        out = runner.step(batch, saves=saves)
        for rid in outs:
            outs[rid].append(out[rid])
    assert_as_cold(torch.cat(outs["x"]), model, seqs["x"], 37)
    assert_as_cold(torch.cat(outs["y"]), model, seqs["y"], 5)

    # The decode row's save (after its one token) resumes like its working state did then.
    # w reads x's K/V of its first 39 tokens (its prompt and two decoded; x is done, so w may write its own
    # token into x's third block).
    runner.share_prefix("x", "w", num_blocks=3, state_slot=runner.saved[("x", 1)])
    runner.computed["w"] = 39
    w_tokens = [*seqs["x"][:39], 11]
    assert_as_cold(runner.step([("w", [11])])["w"], model, w_tokens, 39)
    runner.share_prefix("z", "v", num_blocks=3, state_slot=runner.saved[("z", 3 * BLOCK)])
    v_tokens = [*seqs["z"][: 3 * BLOCK], 12]
    assert_as_cold(runner.step([("v", [12])])["v"], model, v_tokens, 3 * BLOCK)


def test_state_cache_layout_and_copies(models) -> None:
    """Slot-major tensors per recurrent layer whose bytes are state_bytes_per_slot; copies and zeroes move
    whole states between slots."""
    for kind, model in models.items():
        cache = model.allocate_state_cache(5, torch.bfloat16, "cpu")
        assert len(cache) == len(model.config.state_layers)
        total = sum(t[0].numel() * t.element_size() for tensors in cache for t in tensors)
        assert model.state_bytes_per_slot(torch.bfloat16) == total, kind
        assert all(t.shape[0] == 5 and t.abs().sum() == 0 for tensors in cache for t in tensors)
    qwen = models["qwen3_5"]
    cache = qwen.allocate_state_cache(4, torch.float32, "cpu")
    conv, matrix = cache[0]
    assert (conv.shape, matrix.shape, matrix.dtype) == ((4, 3, 2 * 16 + 48), (4, 4, 8, 12), torch.float32)
    # 3 GDN layers of (80 x 3 conv window + 4 x 8 x 12 matrix) float32 values.
    assert qwen.state_bytes_per_slot(torch.float32) == 3 * (80 * 3 + 4 * 8 * 12) * 4
    for tensors in cache:
        for t in tensors:
            t[1], t[2] = 1.0, 2.0
    qwen.copy_states(cache, [1, 2], [2, 3])  # slot 2 is read before it is written
    qwen.zero_states(cache, [1])
    for tensors in cache:
        for t in tensors:
            assert [float(t[i].flatten()[0]) for i in range(4)] == [0.0, 0.0, 1.0, 2.0]


def test_forward_needs_the_state_of_a_hybrid(models) -> None:
    model = models["lfm2"]
    runner = PagedRunner(model, BLOCK)
    runner.step([("a", [1, 2, 3])])
    meta = runner.last_metadata
    ids, positions = torch.tensor([1, 2, 3]), meta[0].positions
    with pytest.raises(ValueError, match="needs state_cache and state_metadata"):
        model(ids, positions, runner.kv_caches, meta)
    state_meta = StateMetadata.build([0], [3], [], "cpu")
    with pytest.raises(ValueError, match="expected 3 recurrent layer states, got 1"):
        model(ids, positions, runner.kv_caches, meta, runner.state_cache[:1], state_meta)


@pytest.mark.parametrize(
    ("slots", "new", "saves", "match"),
    [
        ([0, 1], [3], [], "2 slots for 1 requests"),
        ([0], [0], [], "at least one new token"),
        ([2, 2], [1, 1], [], "distinct"),
        ([0], [4], [(1, 2, 5)], "names request row 1"),
        ([0], [4], [(0, 5, 5)], "outside the request's 4 new tokens"),
        ([0], [4], [(0, 0, 5)], "outside"),
        ([0, 1], [4, 4], [(0, 2, 1)], "no request works in or saves to"),
        ([0], [4], [(0, 2, 5), (0, 4, 5)], "no request works in or saves to"),
    ],
)
def test_state_metadata_rejects_misuse(slots, new, saves, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StateMetadata.build(slots, new, saves, "cpu")


def test_state_metadata_plan() -> None:
    """Multi-token requests run alone, cut at their sorted save points; one-token requests as one batch."""
    meta = StateMetadata.build([4, 0, 7], [1, 40, 1], [(1, 32, 9), (1, 16, 8), (2, 1, 3)], "cpu")
    assert meta.query_start_loc.tolist() == [0, 1, 41, 42]
    assert [(r.start, r.end, r.slot, r.saves) for r in meta.prefills] == [(1, 41, 0, ((16, 8), (32, 9)))]
    assert (meta.step_rows.tolist(), meta.step_slots.tolist(), meta.step_saves) == ([0, 41], [4, 7], ((7, 3),))


def _naive_scan(q, k, v, log_decay, state, beta=None):
    """Token by token in float64: ``S = exp(log_decay) S``, then the delta rule's update with ``beta``, or
    ``S += k v^T`` without; ``o = S^T q``."""
    outs = []
    for t in range(q.shape[0]):
        state = state * log_decay[t].exp()[:, None, None]
        if beta is None:
            state = state + k[t][:, :, None] * v[t][:, None, :]
        else:
            predicted = torch.einsum("hkv,hk->hv", state, k[t])
            state = state + k[t][:, :, None] * ((v[t] - predicted) * beta[t][:, None])[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(outs), state


@pytest.mark.parametrize("length", [1, 5, 64, 150])
def test_chunked_recurrences_equal_the_token_loop(length: int) -> None:
    """The chunked gated delta rule and Mamba2 scan (padding the last chunk) equal the plain recurrence."""
    gen = torch.Generator().manual_seed(length)
    heads, dk, dv = 3, 8, 5

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = (torch.nn.functional.normalize(rand(length, heads, dk), dim=-1) for _ in range(2))
    v, state = rand(length, heads, dv), rand(heads, dk, dv)
    g = -torch.rand(length, heads, generator=gen, dtype=torch.float64) * 3
    beta = torch.rand(length, heads, generator=gen, dtype=torch.float64)
    expected = _naive_scan(q, k, v, g, state, beta)
    for got in (
        gated_delta_rule_chunked(q, k, v, g, beta, state),
        _steps(gated_delta_rule_step, q, k, v, g, beta, state),
    ):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    expected = _naive_scan(q, k, v, g, state)
    got = decayed_linear_attention_chunked(q, k, v, g, state, chunk=16)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(
        _steps(decayed_linear_attention_step, q, k, v, g, state), expected, atol=1e-10, rtol=1e-10
    )


def _steps(step, *inputs):
    """Run a one-token recurrence over each token in turn (a batch of one; it advances its own copy)."""
    *per_token, state = inputs
    state, outs = state[None].clone(), []
    for t in range(per_token[0].shape[0]):
        out, state = step(*(x[t][None] for x in per_token), state)
        outs.append(out[0])
    return torch.stack(outs), state[0]
