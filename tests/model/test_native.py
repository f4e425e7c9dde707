"""The native kernels' loader: built once and loaded as ``torch.ops.prefixcache``, or None with the reason logged
(switched off, or a build that fails), in which case every caller runs its torch path."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from prefixcache.model import attention as attention_mod
from prefixcache.model.native import ENV_SWITCH, native_ops
from tests.model.conftest import PagedRunner

# The loader itself, uncached: native_ops() is cached per process, and the other tests share its answer.
load_native_ops = native_ops.__wrapped__


def test_switched_off_is_none_with_a_log(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(ENV_SWITCH, "0")
    with caplog.at_level(logging.INFO, logger="prefixcache.model.native"):
        assert load_native_ops() is None
    assert f"{ENV_SWITCH}=0" in caplog.text


def test_a_failed_build_is_none_with_a_log(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from torch.utils import cpp_extension

    def failing_build(**options: Any) -> None:
        raise RuntimeError("Error building extension 'prefixcache_native': g++ exited with 1")

    monkeypatch.delenv(ENV_SWITCH, raising=False)
    monkeypatch.setattr(cpp_extension, "load", failing_build)
    with caplog.at_level(logging.WARNING, logger="prefixcache.model.native"):
        assert load_native_ops() is None
    assert "unavailable (Error building extension 'prefixcache_native'" in caplog.text


def decode(model: Any, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    """Three requests prefilled (lengths off and on block boundaries), then greedy decode steps."""
    runner = PagedRunner(model, block_size=4)
    gen = torch.Generator().manual_seed(5)
    prompts = {rid: torch.randint(0, 512, (n,), generator=gen).tolist() for rid, n in (("a", 3), ("b", 8), ("c", 29))}
    out = runner.step(list(prompts.items()))
    steps_out = []
    for _ in range(steps):
        out = runner.step([(rid, [int(logits[-1].argmax())]) for rid, logits in out.items()])
        steps_out.append(out)
    return steps_out


@pytest.mark.parametrize("kind", ["llama", "mistral_window"])
def test_decode_falls_back_to_torch_without_the_kernels(
    kind: str, checkpoint_dirs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the kernels unavailable the decode steps run torch's gather and SDPA, and decode what the kernel
    decodes (within float32 rounding: the kernel sums in another order)."""
    from prefixcache.model import load_model

    if native_ops() is None:
        pytest.skip("prefixcache's CPU kernels are not built here: nothing to compare the fallback with")
    model = load_model(checkpoint_dirs[kind]).model
    calls: list[int] = []
    real_ops = torch.ops.prefixcache
    kernel = real_ops.paged_decode_attention

    class CountingOps:
        """The kernels' namespace with the decode kernel's calls counted (the other kernels as they are)."""

        paged_decode_attention = staticmethod(lambda *args: calls.append(1) or kernel(*args))

        def __getattr__(self, name: str) -> object:
            return getattr(real_ops, name)

    monkeypatch.setattr(torch.ops, "prefixcache", CountingOps())
    native = decode(model)
    assert len(calls) == 3 * model.config.num_layers
    monkeypatch.setattr(attention_mod, "native_ops", lambda: None)
    fallback = decode(model)
    assert len(calls) == 3 * model.config.num_layers
    for ours, theirs in zip(native, fallback, strict=True):
        for rid in ours:
            assert ours[rid].argmax(-1).tolist() == theirs[rid].argmax(-1).tolist()
            torch.testing.assert_close(ours[rid], theirs[rid], atol=1e-5, rtol=1e-5)
