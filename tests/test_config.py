"""``dtype auto``: resolved once, in the frozen config, from the CPU's flags or the device, with the reason."""

import argparse
import dataclasses

import pytest

from prefixcache import config as config_module
from prefixcache.config import EngineConfig, cpu_bfloat16_flag, resolve_dtype
from prefixcache.engine.args import add_engine_args, engine_kwargs

X86_WITH = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
X86_AMX = "flags\t\t: fpu avx512f amx_bf16 amx_tile\n"
X86_WITHOUT = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
ARM_WITH = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes bf16 i8mm\n"
ARM_WITHOUT = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes\n"


@pytest.mark.parametrize(
    ("cpuinfo", "machine", "flag"),
    [
        (X86_WITH, "x86_64", "avx512_bf16"),
        (X86_AMX, "x86_64", "amx_bf16"),
        (X86_WITHOUT, "x86_64", None),
        (ARM_WITH, "aarch64", "bf16"),
        (ARM_WITHOUT, "aarch64", None),
        (ARM_WITH, "x86_64", None),  # an x86 CPU has no flag named bf16 that means it
        ("", "x86_64", None),
    ],
)
def test_the_bfloat16_flag_is_read_from_cpuinfo(cpuinfo, machine, flag):
    assert cpu_bfloat16_flag(cpuinfo, machine) == flag


def test_auto_is_bfloat16_where_the_cpu_has_native_instructions(monkeypatch):
    monkeypatch.setattr(config_module, "cpu_bfloat16_flag", lambda: "avx512_bf16")
    config = EngineConfig()
    assert config.dtype == "bfloat16"
    assert "avx512_bf16" in config.dtype_reason and config.dtype_reason.startswith("auto: bfloat16")


def test_auto_is_float32_on_a_cpu_without_them_and_says_why(monkeypatch):
    monkeypatch.setattr(config_module, "cpu_bfloat16_flag", lambda: None)
    config = EngineConfig(dtype="auto")
    assert config.dtype == "float32"
    assert "no native bfloat16 instructions" in config.dtype_reason


def test_auto_on_a_gpu_is_bfloat16_without_reading_cpu_flags(monkeypatch):
    def fail():
        raise AssertionError("read the CPU flags for a GPU")

    monkeypatch.setattr(config_module, "cpu_bfloat16_flag", fail)
    assert resolve_dtype("auto", "mps") == ("bfloat16", "auto: bfloat16 on a GPU (mps)")


def test_an_explicit_dtype_is_taken_as_asked(monkeypatch):
    monkeypatch.setattr(config_module, "cpu_bfloat16_flag", lambda: "avx512_bf16")
    config = EngineConfig(dtype="float32")
    assert (config.dtype, config.dtype_reason) == ("float32", "float32 as asked")


def test_a_copy_keeps_the_reason_unless_its_dtype_changes(monkeypatch):
    monkeypatch.setattr(config_module, "cpu_bfloat16_flag", lambda: "amx_bf16")
    config = EngineConfig()
    copy = dataclasses.replace(config, model="other")
    assert (copy.dtype, copy.dtype_reason) == (config.dtype, config.dtype_reason)
    assert config == dataclasses.replace(config, dtype_reason="")  # the reason is not part of the settings
    changed = dataclasses.replace(config, dtype="float16")
    assert (changed.dtype, changed.dtype_reason) == ("float16", "float16 as asked")


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16"):
        EngineConfig(dtype="int8")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_retained_fraction", 1.5, "max_retained_fraction must be in"),
        ("max_retained_fraction", -0.1, "max_retained_fraction must be in"),
        ("max_retention_ttl_s", 0, "max_retention_ttl_s must be positive"),
        ("max_tenant_retained_fraction", 2.0, "max_tenant_retained_fraction must be in"),
        ("retention_rule", "sticky", "retention_rule must be one of shared or None, got 'sticky'"),
    ],
)
def test_retention_bounds_out_of_range_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})


def test_the_retention_rule_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert EngineConfig(**engine_kwargs(parser.parse_args([]))).retention_rule is None
    assert EngineConfig(**engine_kwargs(parser.parse_args(["--retention-rule", "shared"]))).retention_rule == "shared"
    with pytest.raises(SystemExit):
        parser.parse_args(["--retention-rule", "sticky"])


def test_steps_run_eagerly_unless_no_enforce_eager_says_compile():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert EngineConfig(**engine_kwargs(parser.parse_args([]))).enforce_eager is True
    assert EngineConfig(**engine_kwargs(parser.parse_args(["--no-enforce-eager"]))).enforce_eager is False
    assert EngineConfig(**engine_kwargs(parser.parse_args(["--enforce-eager"]))).enforce_eager is True


def test_the_scheduling_policy_flag_reaches_the_config_and_an_unknown_one_is_refused():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert EngineConfig(**engine_kwargs(parser.parse_args([]))).scheduling_policy == "fcfs"
    parsed = parser.parse_args(["--scheduling-policy", "cache-aware"])
    assert EngineConfig(**engine_kwargs(parsed)).scheduling_policy == "cache-aware"
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "lpm"])
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, cache-aware, got 'lpm'"):
        EngineConfig(scheduling_policy="lpm")
