"""A GGUF's quantized weights run quantized (``quantized=True``) and agree with the GGUF's dequantized floats."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from prefixcache.engine import LLM, SamplingParams
from prefixcache.model import load_model, quantization
from prefixcache.model.quantization import (
    ConcatLinear,
    GGUFLinear,
    Int4Linear,
    Int8Linear,
    QuantizedEmbedding,
    gguf_ops,
    module_bytes,
)
from tests.helpers import build_tokenizer, write_tiny_checkpoint
from tests.model.test_loader import write_gguf

# The bounds the quantized model keeps against the GGUF's dequantized float32 reference. torch's kernels compute
# in bfloat16 with the group scales rounded to bfloat16; the native kernels (GGUFLinear) quantize the
# activations per block of 32 to int8. Either way the reference's tokens hold until a step whose top two tokens
# are within NEAR_TIE nats, and each token's log-probability within LOGPROB_BOUND nats (SmolLM2-135M from its
# Q4_1 GGUF, 8 prompts x 24 tokens: at most 0.23 with torch's kernels, the same as the float model run in
# bfloat16; the tiny random models here stay well inside it).
NEAR_TIE = 0.25
LOGPROB_BOUND = 0.3
# With int8 activations (GGUFLinear, as llama.cpp computes) SmolLM2 moves further: on the 8 prompts below its
# greedy tokens held until a top-two gap of at most 0.36 and its log-probabilities stayed within 0.33 (float32;
# 0.20 in bfloat16), where llama.cpp on the same GGUF against the same reference: 0.36 and 0.22. The bounds for
# an int8-activation engine are tests/helpers.py's for llama.cpp's (NEAR_TIE_NATS), the log-probabilities 0.4.
NEAR_TIE_INT8 = 0.5
LOGPROB_BOUND_INT8 = 0.4
PROMPTS = [[5, 17, 33, 2], [101, 7, 7, 64, 12, 9], [250, 3], [42] * 20]


def tiny_gguf(tmp_path: Path, weight_type: str, **overrides) -> Path:
    """A tiny Llama (tied embedding unless overridden) as a GGUF whose matrices are ``weight_type``."""
    settings = dict(vocab_size=len(build_tokenizer()), initializer_range=0.05, tie_word_embeddings=True)
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt", "llama", **(settings | overrides))
    return write_gguf(checkpoint, tmp_path / f"tiny-{weight_type}.gguf", weight_type)


def dense_weight(module: torch.nn.Module) -> torch.Tensor:
    """What a quantized module multiplies by, as a float32 ``[N, K]`` (its output for the identity)."""
    eye = torch.eye(module.in_features)
    bias = getattr(module, "bias", None)
    out = module(eye).float()
    return (out - (0 if bias is None else bias.float())).t()


def greedy(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def assert_agrees_until_a_near_tie(
    reference: list, quantized: list, near_tie: float = NEAR_TIE, bound: float = LOGPROB_BOUND
) -> None:
    """Each prompt's greedy tokens equal the reference's up to the first step where the reference's top two are
    within ``near_tie``; every log-probability until then within ``bound``."""
    for (ref_tokens, ref_logprobs), (q_tokens, q_logprobs) in zip(reference, quantized, strict=True):
        for step, (ref_token, q_token) in enumerate(zip(ref_tokens, q_tokens, strict=True)):
            top = sorted(ref_logprobs[step].values(), reverse=True)
            if ref_token != q_token:
                assert top[0] - top[1] < near_tie, f"step {step}: {q_token} instead of {ref_token}, gap {top}"
                break
            assert abs(ref_logprobs[step][ref_token] - q_logprobs[step][q_token]) < bound


needs_native = pytest.mark.skipif(gguf_ops() is None, reason="prefixcache's native CPU kernels are unavailable")
# Q4_K's super-blocks are 256 wide; an untied output projection is quantized on its own.
Q4_K_SHAPES = {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4, "tie_word_embeddings": False}


@pytest.mark.parametrize(
    ("weight_type", "linear_kind", "overrides", "native"),
    [
        ("Q4_0", Int4Linear, {}, False),
        ("Q4_1", Int4Linear, {}, False),
        ("Q8_0", Int8Linear, {}, False),
        ("Q4_K", Int4Linear, Q4_K_SHAPES, False),
        pytest.param("Q4_0", GGUFLinear, {}, True, marks=needs_native),
        pytest.param("Q4_1", GGUFLinear, {}, True, marks=needs_native),
        pytest.param("Q8_0", GGUFLinear, {}, True, marks=needs_native),
        pytest.param("Q4_K", GGUFLinear, Q4_K_SHAPES, True, marks=needs_native),
    ],
)
def test_quantized_weights_match_the_dequantized_reference(
    weight_type: str, linear_kind: type, overrides: dict, native: bool, tmp_path: Path, monkeypatch, make_llm
) -> None:
    """With the native kernels (GGUFLinear) and without them (torch's kernels, the fallback)."""
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    if not native:
        monkeypatch.setattr(quantization, "gguf_ops", lambda: None)
    gguf_path = tiny_gguf(tmp_path, weight_type, **overrides)
    reference = load_model(gguf_path)  # transformers' dequantization, float32
    quantized = load_model(gguf_path, quantized=True)
    assert quantized.quantized and not reference.quantized
    assert quantized.weights_digest != reference.weights_digest  # other K/V: another offload namespace

    ref_modules = dict(reference.model.named_modules())
    linears = {
        name: m
        for name, m in quantized.model.named_modules()
        if isinstance(m, Int4Linear | Int8Linear | GGUFLinear) and name in ref_modules  # not the embedding's table
    }
    assert {type(m) for name, m in linears.items() if name != "lm_head"} == {linear_kind}
    assert not any(isinstance(m, torch.nn.Linear) for m in quantized.model.modules())
    assert isinstance(quantized.model.model.embed_tokens, QuantizedEmbedding)
    for name, module in linears.items():
        expected = ref_modules[name].weight.float()
        # int4 is the GGUF's own integers with bfloat16 scales; int8 a per-channel requantization; GGUFLinear the
        # GGUF's integers and float16 scales (exact but Q4_K's, products rounded to float16: within 2^-11 of
        # scale * 15 + |min|), the identity's rows quantized exactly
        if isinstance(module, GGUFLinear):
            tolerance = 2**-10 * expected.abs().amax() if weight_type == "Q4_K" else 1e-6
            torch.testing.assert_close(dense_weight(module), expected, atol=float(tolerance), rtol=0)
            continue
        tolerance = 2**-7 if isinstance(module, Int4Linear) else expected.abs().amax() / 127
        torch.testing.assert_close(dense_weight(module), expected, atol=float(tolerance), rtol=2**-7)
    ids = torch.arange(quantized.config.vocab_size)
    embed = quantized.model.model.embed_tokens(ids).float()
    torch.testing.assert_close(embed, reference.model.model.embed_tokens(ids), atol=2**-6, rtol=2**-6)

    # Held in memory: at most 1.3x the GGUF's tensor bytes (int4: the file's nibbles plus bfloat16 group scales).
    import gguf

    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(gguf_path).tensors)
    assert module_bytes(quantized.model) <= 1.3 * file_bytes

    expected_tokens = greedy(make_llm(loaded=reference))
    assert_agrees_until_a_near_tie(expected_tokens, greedy(make_llm(loaded=quantized, quantization="gguf")))


def test_quantized_outputs_are_the_same_with_and_without_the_cache(tmp_path: Path, monkeypatch, make_llm) -> None:
    """The prefix cache changes nothing: a prompt sharing a cached prefix decodes as it does cold (float32)."""
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    quantized = load_model(tiny_gguf(tmp_path, "Q4_1"), quantized=True)
    prompts = [list(range(3, 40)), list(range(3, 40)) + [7, 8, 9]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    results = {}
    for caching in (False, True):
        llm = make_llm(loaded=quantized, quantization="gguf", enable_prefix_caching=caching)
        llm.generate(prompts[:1], params)  # the second prompt's prefix is cached now (when caching)
        outputs = llm.generate(prompts, params)
        assert (outputs[1].num_cached_tokens > 0) == caching
        results[caching] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    assert results[True] == results[False]


@needs_native
def test_packed_weights_lie_in_one_region_and_count_only_their_own_bytes(tmp_path: Path, monkeypatch) -> None:
    """Every GGUFLinear's tiles are slices of one region (huge pages where the OS gives them), 64-byte aligned;
    a layer's bytes are its own tensors', not the region's."""
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    model = load_model(tiny_gguf(tmp_path, "Q4_1"), quantized=True).model
    packed = [m.packed for m in model.modules() if isinstance(m, GGUFLinear)]
    assert len(packed) == 4 * len(model.model.layers)  # each layer's four products (a Q4_1 table is int8 rows)
    assert len({p.untyped_storage().data_ptr() for p in packed}) == 1
    assert all(p.data_ptr() % 64 == 0 for p in packed)
    layer = model.model.layers[0]
    own = [*layer.parameters(), *layer.buffers()]
    assert module_bytes(layer) == sum(t.nbytes for t in own) < packed[0].untyped_storage().nbytes()


@pytest.mark.parametrize(
    ("native", "four_bit_kind"), [(False, Int4Linear), pytest.param(True, GGUFLinear, marks=needs_native)]
)
def test_a_fused_projection_of_mixed_types_runs_each_part_with_its_kernel(
    native: bool, four_bit_kind: type, monkeypatch
) -> None:
    """Q4_K_M stores some V weights in Q6_K: the fused QKV then runs 4-bit parts (natively where it can) and an
    int8 part, concatenated."""
    from prefixcache.model.quantization import GGUFWeight, build_linear

    if not native:
        monkeypatch.setattr(quantization, "gguf_ops", lambda: None)
    torch.manual_seed(0)
    q = torch.randint(0, 16, (32, 64), dtype=torch.uint8).numpy()
    scale, minimum = torch.full((32, 2), 0.01).numpy(), torch.full((32, 2), -0.08).numpy()
    four_bit = GGUFWeight("Q4_0", (q * 0.01 - 0.08).astype("float32"), q, scale, minimum)
    six_bit = GGUFWeight("Q6_K", torch.randn(16, 64).numpy())
    bias = torch.randn(48)
    module = build_linear([four_bit, six_bit], bias, "cpu")
    assert isinstance(module, ConcatLinear)
    assert [type(part) for part in module.parts] == [four_bit_kind, Int8Linear]
    x = torch.rand(3, 64)
    expected = x @ torch.cat([torch.from_numpy(four_bit.dense), torch.from_numpy(six_bit.dense)]).t() + bias
    out = module(x)
    # the 4-bit rows are the exact integers (bfloat16 or int8 activations); the int8 rows are requantized from randn
    torch.testing.assert_close(out[:, :32], expected[:, :32], atol=0.02, rtol=0.01)
    torch.testing.assert_close(out[:, 32:], expected[:, 32:], atol=0.15, rtol=0.02)


def test_a_converted_folder_quantizes_from_its_gguf(tmp_path: Path, monkeypatch) -> None:
    """The server hands its engine core the converted folder; the core reads the quantized weights from the GGUF."""
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = tiny_gguf(tmp_path, "Q4_0")
    folder = load_model(gguf_path).model_dir
    assert folder.parent == tmp_path / "cache" / "models"
    assert load_model(folder, quantized=True).quantized


def test_quantized_needs_a_gguf(checkpoint_dirs) -> None:
    with pytest.raises(ValueError, match=r"quantization 'gguf' needs a \.gguf model file"):
        load_model(checkpoint_dirs["llama"], quantized=True)


def test_engine_refuses_a_model_loaded_otherwise(make_llm) -> None:
    with pytest.raises(ValueError, match="weights are floats but the engine runs quantization='gguf'"):
        make_llm(quantization="gguf")


@pytest.mark.slow
def test_smollm2_quantized_matches_its_float_reference() -> None:
    """SmolLM2-135M from its Q4_1 GGUF: weights in at most 1.3x the file's bytes, and on a fixed prompt set the
    reference's greedy tokens until a near-tie, with log-probabilities within the bound."""
    from prefixcache.model.loader import default_gguf_path

    reference = load_model(dtype="float32")
    quantized = load_model(dtype="bfloat16", quantized=True)
    assert module_bytes(quantized.model) <= 1.3 * default_gguf_path().stat().st_size
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time",
        "The three primary colors are",
        "Water boils at",
        "List of planets:",
        "In 1492,",
        "My favourite food is",
    ]
    prompts = [reference.tokenizer(text).input_ids for text in texts]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    runs = []
    for loaded, dtype, mode in ((reference, "float32", "none"), (quantized, "bfloat16", "gguf")):
        llm = LLM(loaded=loaded, dtype=dtype, quantization=mode, kv_cache_memory="64MiB")
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)])
        llm.engine.close()
    native = any(isinstance(m, GGUFLinear) for m in quantized.model.modules())
    assert_agrees_until_a_near_tie(*runs, *((NEAR_TIE_INT8, LOGPROB_BOUND_INT8) if native else ()))


@needs_native
def test_a_compiled_decode_step_runs_the_native_kernels(tmp_path: Path, monkeypatch, caplog) -> None:
    """``compile_decode`` traces GGUFLinear's ops (their fake implementations) and its steps give the eager ones'."""
    from tests.model.conftest import PagedRunner
    from tests.model.test_decoder import assert_compiled_matches, decode_logits, warnings_logged

    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler (g++) for inductor's CPU kernels")
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    model = load_model(tiny_gguf(tmp_path, "Q4_1"), quantized=True).model
    assert any(isinstance(m, GGUFLinear) for m in model.modules())

    prompts = dict(zip("ab", PROMPTS, strict=False))
    eager = decode_logits(model, num_blocks=64, prompts=prompts)
    runner = PagedRunner(model, block_size=4, num_blocks=64)
    assert model.compile_decode(runner.kv_caches, runner.groups, runner.block_size) is not None
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert_compiled_matches(decode_logits(model, num_blocks=64, prompts=prompts), eager)
    assert not warnings_logged(caplog)  # compiled, not eager
