"""The model on a CUDA device gives the CPU's results: float32 decoding, the quantized weight-only matmuls and the
compiled decode step.

Skipped with the reason where torch sees no CUDA device; ``benchmarks/device_check.sh`` runs them on one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixcache.engine import LLM, SamplingParams
from prefixcache.model import load_model
from prefixcache.model.quantization import Int4Linear, Int8Linear, int8_per_channel
from tests.model.test_quantization import PROMPTS, assert_agrees_until_a_near_tie, greedy, tiny_gguf

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)"),
]


def test_int4_and_int8_linears_match_the_cpu() -> None:
    torch.manual_seed(0)
    q = torch.randint(0, 16, (64, 128), dtype=torch.uint8)
    scale, minimum = torch.rand(64, 4) * 0.01, -torch.rand(64, 4) * 0.05
    dense = torch.randn(48, 128)
    x = torch.randn(5, 128)
    for build in (
        lambda device: Int4Linear(q, scale, minimum, None, device),
        lambda device: Int8Linear(*int8_per_channel(dense), torch.randn(48), device),
    ):
        cpu, cuda = build("cpu"), build("cuda")
        torch.testing.assert_close(cuda(x.cuda()).cpu(), cpu(x), atol=2e-2, rtol=2e-2)


def test_float32_decoding_matches_the_cpu(tiny_llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    results = {}
    for device in ("cpu", "cuda"):
        loaded = load_model(tiny_llama_dir, dtype="float32", device=device)
        llm = LLM(str(tiny_llama_dir), loaded=loaded, dtype="float32", device=device, num_blocks=64, block_size=4)
        results[device] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, params)]
        llm.engine.close()
    for (cpu_tokens, cpu_logprobs), (cuda_tokens, cuda_logprobs) in zip(results["cpu"], results["cuda"], strict=True):
        assert cuda_tokens == cpu_tokens
        for cpu_step, cuda_step in zip(cpu_logprobs, cuda_logprobs, strict=True):
            assert cuda_step.keys() == cpu_step.keys()
            assert all(abs(cuda_step[t] - cpu_step[t]) < 1e-3 for t in cpu_step)


def test_quantized_decoding_matches_the_cpu(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = tiny_gguf(tmp_path, "Q4_1")
    results = {}
    for device in ("cpu", "cuda"):
        loaded = load_model(gguf_path, dtype="bfloat16", device=device, quantized=True)
        llm = LLM(str(gguf_path), loaded=loaded, dtype="bfloat16", device=device, quantization="gguf", num_blocks=64)
        results[device] = greedy(llm)
        llm.engine.close()
    assert_agrees_until_a_near_tie(results["cpu"], results["cuda"])


def test_compiled_decoding_matches_eager_on_the_device(tiny_llama_dir: Path) -> None:
    """The compiled decode step (``enforce_eager=False``) is device-agnostic: on CUDA (inductor's Triton kernels)
    it decodes the eager step's tokens, with log-probabilities within float32 rounding of the fused ops."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    results = {}
    loaded = load_model(tiny_llama_dir, dtype="float32", device="cuda")
    for eager in (True, False):
        llm = LLM(
            str(tiny_llama_dir),
            loaded=loaded,
            dtype="float32",
            device="cuda",
            num_blocks=64,
            block_size=4,
            enforce_eager=eager,
        )
        assert (llm.engine.core.decode_compile_s is None) == eager
        results[eager] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, params)]
        llm.engine.close()
    for (eager_tokens, eager_logprobs), (tokens, logprobs) in zip(results[True], results[False], strict=True):
        assert tokens == eager_tokens
        for eager_step, step in zip(eager_logprobs, logprobs, strict=True):
            assert step.keys() == eager_step.keys()
            assert all(abs(step[t] - eager_step[t]) < 1e-4 for t in eager_step)
