"""The paged model must reproduce transformers' logits however a sequence is split into steps and batches."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from prefixcache.model import AttentionMetadata, DecoderForCausalLM, load_model
from prefixcache.model import attention as attention_mod
from prefixcache.model.attention import _partition
from tests.helpers import write_tiny_checkpoint
from tests.model.conftest import TINY_MODELS, TINY_SETTINGS, VOCAB_SIZE, PagedRunner

ATOL = RTOL = 1e-4


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf_model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def assert_matches(ours: torch.Tensor, hf_model: Any, tokens: list[int], start: int) -> None:
    """Our logits for tokens[start:] equal HF's full-sequence forward at those positions."""
    expected = hf_logits(hf_model, tokens)[start:]
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=RTOL)


@pytest.fixture(scope="module")
def models(checkpoint_dirs: dict[str, Path]) -> dict[str, DecoderForCausalLM]:
    return {kind: load_model(path).model for kind, path in checkpoint_dirs.items()}


@pytest.mark.parametrize("kind", list(TINY_MODELS))
def test_prompt_in_one_step(kind: str, models, hf_models) -> None:
    tokens = random_tokens(37, seed=1)
    out = PagedRunner(models[kind], block_size=4).step([("a", tokens)])
    assert_matches(out["a"], hf_models[kind], tokens, 0)


@pytest.mark.parametrize("kind", ["llama", "qwen2_tied", "mistral_window", "llama3_rope", "qwen3_window", "gemma3"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_prompt_in_chunks(kind: str, block_size: int, models, hf_models) -> None:
    tokens = random_tokens(45, seed=2)
    runner = PagedRunner(models[kind], block_size)
    pieces, pos = [], 0
    for size in (5, 1, 11, 3, 17, 1, 1, 6):
        pieces.append(runner.step([("a", tokens[pos : pos + size])])["a"])
        pos += size
    assert_matches(torch.cat(pieces), hf_models[kind], tokens, 0)


@pytest.mark.parametrize("kind", ["llama", "mistral_window", "gemma3"])
def test_long_step_after_cached_context(kind: str, models, hf_models) -> None:
    """More new tokens than one query chunk (attended in several chunks) on top of earlier context."""
    tokens = random_tokens(1330, seed=6)
    runner = PagedRunner(models[kind], block_size=16, num_blocks=90)
    first = runner.step([("a", tokens[:101])])["a"]
    rest = runner.step([("a", tokens[101:])])["a"]
    assert_matches(torch.cat([first, rest]), hf_models[kind], tokens, 0)


@pytest.mark.parametrize("kind", ["llama", "qwen2_tied", "mistral_window", "qwen3_window", "gemma3"])
def test_prefix_written_by_another_request(kind: str, models, hf_models) -> None:
    block_size = 4
    prefix = random_tokens(16, seed=3)
    a_tokens = [*prefix, *random_tokens(6, seed=4)]
    b_tokens = [*prefix, *random_tokens(13, seed=5)]
    runner = PagedRunner(models[kind], block_size)
    runner.step([("a", a_tokens)])
    runner.share_prefix("a", "b", num_blocks=len(prefix) // block_size)
    out = runner.step([("b", b_tokens[len(prefix) :])])
    assert_matches(out["b"], hf_models[kind], b_tokens, len(prefix))
    # B keeps decoding on top of the shared blocks.
    b_tokens.append(5)
    out = runner.step([("b", [5])])
    assert_matches(out["b"], hf_models[kind], b_tokens, len(b_tokens) - 1)


def run_mixed_batch(model: DecoderForCausalLM, hf_model: Any, **runner_options: Any) -> None:
    """Two prefill chunks, two decodes, and a request reading blocks another one writes in the same step."""
    block_size = 4
    runner = PagedRunner(model, block_size, **runner_options)
    seqs = {rid: random_tokens(n, seed=10 + i) for i, (rid, n) in enumerate([("p", 15), ("d1", 13), ("d2", 21)])}
    runner.step([("p", seqs["p"][:8]), ("d1", seqs["d1"][:12])])
    runner.step([("d2", seqs["d2"][:20])])

    seqs["x"] = random_tokens(12, seed=20)
    seqs["y"] = [*seqs["x"][:8], *random_tokens(7, seed=21)]
    runner.reserve("x", 3)
    runner.share_prefix("x", "y", num_blocks=2)  # y's first 8 tokens are being written by x in this step
    batch = [
        ("x", seqs["x"]),
        ("d1", seqs["d1"][12:]),
        ("p", seqs["p"][8:]),
        ("y", seqs["y"][8:]),
        ("d2", seqs["d2"][20:]),
    ]
    out = runner.step(batch)
    for rid, new_tokens in batch:
        seq = seqs[rid]
        assert_matches(out[rid], hf_model, seq, len(seq) - len(new_tokens))


@pytest.mark.parametrize("kind", ["llama", "qwen2_tied", "mistral_window", "llama_bias", "qwen3_window", "gemma3"])
def test_mixed_batch(kind: str, models, hf_models) -> None:
    run_mixed_batch(models[kind], hf_models[kind])


@pytest.mark.parametrize("kind", ["llama", "mistral_window", "qwen3_window"])
def test_mixed_batch_on_the_torch_path(kind: str, models, hf_models, torch_attention) -> None:
    """Where prefixcache's prefill kernel is unavailable, the grouped SDPA path attends every request."""
    run_mixed_batch(models[kind], hf_models[kind])


def test_mixed_batch_with_expanded_kv(models, hf_models, monkeypatch: pytest.MonkeyPatch, torch_attention) -> None:
    """The K/V-expansion path taken on CUDA for masked GQA gives the same result."""
    monkeypatch.setattr(attention_mod, "_sdpa_gqa_supported", lambda device, mask: False)
    run_mixed_batch(models["llama"], hf_models["llama"])


def test_decode_batch_of_varied_lengths(models, hf_models) -> None:
    """Many decodes of different lengths across several steps, plus one long request in its own group."""
    model, hf_model = models["llama"], hf_models["llama"]
    runner = PagedRunner(model, block_size=4, num_blocks=1200)
    lengths = {"a": 3, "b": 9, "c": 17, "d": 1, "long": 2200}
    seqs = {rid: random_tokens(n + 4, seed=30 + i) for i, (rid, n) in enumerate(lengths.items())}
    runner.step([(rid, seqs[rid][:n]) for rid, n in lengths.items()])
    for extra in range(4):
        order = list(lengths)[extra:] + list(lengths)[:extra]
        out = runner.step([(rid, [seqs[rid][lengths[rid] + extra]]) for rid in order])
    for rid, n in lengths.items():
        assert_matches(out[rid], hf_model, seqs[rid][: n + 4], n + 3)


@pytest.mark.parametrize("path", ["torch", "kernel"])
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_bfloat16_close_to_transformers(
    kind: str, path: str, checkpoint_dirs, hf_models, request: pytest.FixtureRequest
) -> None:
    """bfloat16 can't match bit for bit: it must be about as far from float32 as HF's bfloat16 is (Gemma's
    sandwich norms and soft-capping lose more to bfloat16 than Llama does). The torch path runs the same SDPA as HF,
    so it must also stay close to HF's bfloat16; the native prefill kernel rounds differently (its own softmax, in
    float32), so on Gemma it lands as far from HF's bfloat16 as that is from float32, not closer."""
    from transformers import AutoModelForCausalLM

    if path == "kernel" and attention_mod._prefill_kernel() is None:
        pytest.skip("prefixcache's CPU kernels are unavailable here")
    if path == "torch":
        request.getfixturevalue("torch_attention")
    model_path = checkpoint_dirs[kind]
    model = load_model(model_path, dtype="bfloat16").model
    hf_bf16 = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, local_files_only=True)
    tokens = random_tokens(30, seed=40)
    runner = PagedRunner(model, block_size=4)
    ours = torch.cat([runner.step([("a", tokens[:20])])["a"], runner.step([("a", tokens[20:])])["a"]])
    expected_fp32 = hf_logits(hf_models[kind], tokens)
    expected_bf16 = hf_logits(hf_bf16, tokens)
    assert ours.dtype == torch.float32
    bound = 0.03 * expected_fp32.abs().max()
    hf_error = (expected_bf16 - expected_fp32).abs()
    assert (ours - expected_bf16).abs().max() < (bound if path == "torch" else max(bound, hf_error.max()))
    assert (ours - expected_fp32).abs().max() < max(bound, 1.25 * hf_error.max())
    assert (ours - expected_fp32).abs().mean() < 1.25 * hf_error.mean()


def test_metadata_build() -> None:
    meta = AttentionMetadata.build([[7, 2, 9], [4], [5, 6, 0, 3]], [5, 0, 8], [3, 2, 1], 4, "cpu")
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 16, 17, 0 * 4 + 0]
    assert meta.positions.tolist() == [5, 6, 7, 0, 1, 8]
    assert meta.query_start_loc.tolist() == [0, 3, 5, 6]
    assert meta.seq_lens.tolist() == [8, 2, 9]
    assert meta.last_token_indices.tolist() == [2, 4, 5]
    assert meta.block_tables.tolist() == [[7, 2, 0], [4, 0, 0], [5, 6, 0]]
    assert meta.slot_mapping.dtype == torch.int64 and meta.num_tokens == 6
    assert meta.max_seq_len == 9 and not meta.decodes_only


def test_decode_metadata_builds_its_groups_only_when_asked() -> None:
    """A step of decodes takes DecodeAttention: its SDPA groups are left unbuilt unless something reads them."""
    meta = AttentionMetadata.build([[7, 2, 9], [4]], [9, 2], [1, 1], 4, "cpu")
    assert meta.decodes_only and meta.max_seq_len == 10 and meta.decode_inputs() is not None
    assert meta._groups is None
    (group,) = meta.groups
    assert group.max_q == 1 and group.kv_lens.tolist() == [10, 3]
    assert meta.groups is meta.groups  # built once


def test_rope_tables_grow_and_keep_each_positions_values(models) -> None:
    """cos and signed sin of a position from the model's tables are those computed from the position alone (HF's
    float32 order, then cast), and stay the same when a longer sequence doubles the tables."""
    model = models["llama"]
    (inv_freq,) = model._inv_freq_cpu
    dtype = model.model.norm.weight.dtype

    def alone(positions: torch.Tensor) -> torch.Tensor:
        freqs = (positions[:, None].float() * inv_freq)[:, None, :]
        sin = freqs.sin().to(dtype)
        return torch.cat((torch.cat((freqs, freqs), dim=-1).cos().to(dtype), torch.cat((-sin, sin), dim=-1)), 1)

    positions = torch.tensor([0, 1, 63, 4095])
    rows = model._rope(positions, 4096)[0]
    assert torch.equal(rows, alone(positions))
    assert model._rope_tables_for(positions.device, dtype, 1)[0].shape[0] == 4096
    longer = torch.tensor([0, 1, 63, 4095, 9000])
    longer_rows = model._rope(longer, 9001)[0]
    assert model._rope_tables_for(positions.device, dtype, 1)[0].shape[0] == 16384
    assert torch.equal(longer_rows[:4], rows) and torch.equal(longer_rows, alone(longer))


@pytest.mark.parametrize(
    ("tables", "computed", "new", "match"),
    [
        ([[1]], [3], [2], "block table"),
        ([[1]], [0], [0], "num_new"),
        ([[1], [2]], [0], [1, 1], "one entry per request"),
        ([], [], [], "at least one request"),
    ],
)
def test_metadata_rejects_bad_input(tables, computed, new, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AttentionMetadata.build(tables, computed, new, 4, "cpu")


def test_partition_keeps_padding_small() -> None:
    computed = np.array([1000, 0, 990, 5000, 20], dtype=np.int64)
    new = np.array([1, 2000, 1, 1, 1], dtype=np.int64)
    groups = [g.tolist() for g in _partition(computed, new, np.zeros_like(computed))]
    assert sorted(groups) == [[0, 2, 4], [1], [3]]


def test_long_query_runs_are_chunked() -> None:
    """1200 new tokens after a cached prefix attend in 512-query chunks, each to keys up to its own end."""
    meta = AttentionMetadata.build([list(range(200))], [100], [1200], 16, "cpu")
    assert sorted((g.token_slice, g.max_q, g.kv_len) for g in meta.groups) == [
        ((0, 512), 512, 39 * 16),
        ((512, 1024), 512, 71 * 16),
        ((1024, 1200), 176, 82 * 16),
    ]
    fresh = AttentionMetadata.build([list(range(200))], [0], [1200], 16, "cpu")
    assert len(fresh.groups) == 1 and fresh.groups[0].fresh


def test_padded_rows_stay_finite(models) -> None:
    """Padding query rows and unused cache slots never turn into NaN, even with garbage in free blocks."""
    model = models["llama"]
    runner = PagedRunner(model, block_size=4)
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    out = runner.step([("a", random_tokens(9, seed=50)), ("b", random_tokens(2, seed=51))])
    assert all(torch.isfinite(t).all() for t in out.values())


def test_cache_sizing(models) -> None:
    model = models["llama"]
    cfg = model.config
    caches = model.allocate_kv_cache(10, 16, torch.bfloat16, "cpu")
    assert len(caches) == cfg.num_layers
    assert caches[0][0].shape == (10, 16, cfg.num_kv_heads, cfg.head_dim)
    assert caches[0][1].dtype == torch.bfloat16
    tensors = [t for pair in caches for t in pair]
    assert all(t.is_contiguous() and not t.any() for t in tensors)  # zeroed: masked slots enter the matmuls
    # each layer's K and V its own storage (huge pages on a CPU): no two inputs of a compiled step alias
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 2
    assert model.kv_bytes_per_block(16, torch.bfloat16) == per_block
    assert model.kv_bytes_per_block(16) == 2 * per_block  # float32 model


DECODE_BLOCKS = 200  # the K/V pool of decode_logits


DECODE_PROMPTS = {rid: random_tokens(n, seed=60 + i) for i, (rid, n) in enumerate({"a": 2, "b": 9, "c": 41}.items())}


def decode_logits(
    model: DecoderForCausalLM,
    steps: int = 3,
    num_blocks: int = DECODE_BLOCKS,
    prompts: dict[str, list[int]] = DECODE_PROMPTS,
) -> list[dict[str, torch.Tensor]]:
    """Prefill ``prompts`` (by default three, one past the tiny models' windows), then ``steps`` steps of greedy
    decodes, on a K/V pool of its own; allocated as the engine's, outside inference mode, and stepped as the
    engine's, inside it (a compiled step's graphs are guarded on both)."""
    runner = PagedRunner(model, block_size=4, num_blocks=num_blocks)
    with torch.inference_mode():
        out = runner.step(list(prompts.items()))
        steps_out = []
        for _ in range(steps):
            out = runner.step([(rid, [int(logits[-1].argmax())]) for rid, logits in out.items()])
            steps_out.append(out)
    return steps_out


@pytest.mark.parametrize("kind", ["llama", "qwen2_tied", "mistral_window", "gemma3"])
def test_decode_step_equals_the_grouped_attention(kind: str, models, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of decodes only takes the decode path (one K/V write, one SDPA over the padded tables with a mask a
    window) and computes exactly what the grouped paged attention does, bit for bit."""
    model = models[kind]
    taken: list[int] = []
    eager = model._decode_step
    monkeypatch.setattr(model, "_decode_step", lambda *inputs: taken.append(1) or eager(*inputs))
    decoded = decode_logits(model)
    assert len(taken) == 3
    monkeypatch.setattr(AttentionMetadata, "decode_inputs", lambda self, share_prefixes=False: None)
    grouped = decode_logits(model)
    assert len(taken) == 3
    for ours, theirs in zip(decoded, grouped, strict=True):
        for rid in ours:
            assert torch.equal(ours[rid], theirs[rid])


def warnings_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings logged so far: a compiled step that failed (a recompile made an error) and fell back to the
    eager one says so in one, and the eager step's results would match any comparison."""
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def assert_compiled_matches(compiled: list[dict[str, torch.Tensor]], eager: list[dict[str, torch.Tensor]]) -> None:
    """The eager steps' greedy tokens, with logits within float32 rounding of fusing the elementwise ops."""
    for ours, theirs in zip(compiled, eager, strict=True):
        for rid in ours:
            assert ours[rid].argmax(-1).tolist() == theirs[rid].argmax(-1).tolist()
            torch.testing.assert_close(ours[rid], theirs[rid], atol=1e-5, rtol=1e-5)


def test_compiled_decode_matches_eager(checkpoint_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    """``compile_decode`` compiles both graphs at once (one request, more), and the compiled steps give the eager
    steps' results on K/V tensors other than the ones they were compiled on (a new pool of the same size, as an
    engine's after a restart), without compiling again: one request as well as three, at any table width (the
    one-request graph once took its width of 2 blocks from the RoPE rows' 2 and compiled again at 3)."""
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler (g++) for inductor's CPU kernels")
    model = load_model(checkpoint_dirs["llama"]).model
    alone = {"a": random_tokens(13, seed=60)}  # 4 blocks of 4 and more
    eager = decode_logits(model)
    eager_alone = decode_logits(model, steps=5, prompts=alone)
    runner = PagedRunner(model, block_size=4, num_blocks=DECODE_BLOCKS)
    seconds = model.compile_decode(runner.kv_caches, runner.groups, runner.block_size)
    assert seconds is not None and seconds > 0
    assert all(not k[0].any() and not v[0].any() for k, v in runner.kv_caches)  # the warm-up's block, zeroed
    # both graphs compiled: none in the steps (run in inference mode, as the engine's are)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = decode_logits(model)
        compiled_alone = decode_logits(model, steps=5, prompts=alone)
    assert not warnings_logged(caplog)  # no recompile, no eager fallback
    assert_compiled_matches(compiled, eager)
    assert_compiled_matches(compiled_alone, eager_alone)


def test_compiled_decode_guards_its_inputs_and_model(
    checkpoint_dirs: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The compiled steps skip the guards on the model (see ``_guards_on_inputs``) but not on their inputs or on
    which model runs them: a K/V pool of another size runs the same graphs correctly (its number of blocks is a
    dynamic size), and a second model of the same shapes whose norms' eps (a constant inside the graphs) differs
    gets graphs of its own instead of running the first one's."""
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler (g++) for inductor's CPU kernels")
    first = load_model(checkpoint_dirs["llama"]).model
    settings = TINY_SETTINGS | TINY_MODELS["llama"][1] | {"rms_norm_eps": 0.5}
    second = load_model(write_tiny_checkpoint(tmp_path / "eps", "llama", 0, randomize_norms=True, **settings)).model
    eager = {"first": decode_logits(first, num_blocks=64), "second": decode_logits(second)}
    assert not torch.allclose(eager["first"][0]["a"], eager["second"][0]["a"])  # the eps matters
    for model in (first, second):
        runner = PagedRunner(model, block_size=4, num_blocks=DECODE_BLOCKS)
        assert model.compile_decode(runner.kv_caches, runner.groups, runner.block_size) is not None
    assert_compiled_matches(decode_logits(first, num_blocks=64), eager["first"])
    assert_compiled_matches(decode_logits(second), eager["second"])
    assert not warnings_logged(caplog)  # compiled, not eager


def test_failed_compilation_decodes_eagerly(
    checkpoint_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A compilation that fails (here: no C++ compiler) is one warning, and every step still runs, eagerly."""

    def broken_compile(fn: Any, **options: Any) -> Any:
        def run(*inputs: Any) -> Any:
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nlong trace")

        return run

    model = load_model(checkpoint_dirs["llama"]).model
    eager = decode_logits(model)
    runner = PagedRunner(model, block_size=4)
    monkeypatch.setattr(torch, "compile", broken_compile)
    assert model.compile_decode(runner.kv_caches, runner.groups, runner.block_size) is None
    assert warnings_logged(caplog) == [
        f"torch.compile of {what} failed, running it eagerly: InvalidCxxCompiler: No working C++ compiler found"
        for what in ("the decode step", "the logits")
    ]
    for ours, theirs in zip(decode_logits(model), eager, strict=True):
        for rid in ours:
            assert torch.equal(ours[rid], theirs[rid])


def test_compiled_cpu_steps_get_a_cpp_wrapper(
    checkpoint_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU both graphs are compiled with inductor's C++ wrapper, which calls a step's few hundred kernels
    without a Python call each (a fifth of a batch-1 step otherwise)."""
    options: list[dict[str, Any]] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: options.append(kwargs["options"]) or fn)
    model = load_model(checkpoint_dirs["llama"]).model
    runner = PagedRunner(model, block_size=4)
    assert model.compile_decode(runner.kv_caches, runner.groups, runner.block_size) is not None
    assert [o["cpp_wrapper"] for o in options] == [True, True]


def test_compile_decode_skips_what_never_decodes_on_its_path(checkpoint_dirs: dict[str, Path]) -> None:
    """Sliding-window groups gather from their window's first block, so their steps stay on the grouped path and
    there is nothing to compile."""
    model = load_model(checkpoint_dirs["mistral_window"]).model
    groups = model.config.kv_cache_groups(hybrid=True)
    runner = PagedRunner(model, block_size=4, groups=groups)
    assert model.compile_decode(runner.kv_caches, groups, 4) is None
