"""One frozen, validated engine configuration; components take plain arguments from it."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixcache.core import HASH_ALGOS
from prefixcache.core.eviction import EVICTION_POLICIES
from prefixcache.core.retention import DEFAULT_MAX_RETAINED_FRACTION, DEFAULT_MAX_RETENTION_TTL_S, check_bounds
from prefixcache.core.retention_rules import RETENTION_RULES
from prefixcache.kv_events.config import KVEventsConfig
from prefixcache.offload.config import OffloadConfig
from prefixcache.units import parse_memory

__all__ = [
    "DTYPES",
    "QUANTIZATIONS",
    "SCHEDULING_POLICIES",
    "EngineConfig",
    "cpu_bfloat16_flag",
    "parse_memory",
    "resolve_dtype",
]

DTYPES = ("auto", "float32", "bfloat16", "float16")
# Kept here (torch-free) and checked by the loader too: "gguf" keeps a GGUF's quantized weights quantized.
QUANTIZATIONS = ("none", "gguf")
# The order in which waiting requests are admitted (engine/scheduler.py): first come first served, or the fewest
# uncached prompt tokens first, with aging (vLLM's --scheduling-policy names the option; SGLang's lpm is akin).
SCHEDULING_POLICIES = ("fcfs", "cache-aware")
# CPU flags that mean native bfloat16 matrix products (torch's oneDNN kernels use them); without one, a bfloat16
# matmul is emulated and runs several times slower than float32.
_BFLOAT16_FLAGS = {"x86_64": ("amx_bf16", "avx512_bf16"), "amd64": ("amx_bf16", "avx512_bf16"), "aarch64": ("bf16",)}
_BFLOAT16_FLAGS["arm64"] = _BFLOAT16_FLAGS["aarch64"]


def cpu_bfloat16_flag(cpuinfo: str | None = None, machine: str | None = None) -> str | None:
    """The CPU flag that gives native bfloat16 (``amx_bf16``, ``avx512_bf16`` on x86; ``bf16`` on aarch64), read
    from ``/proc/cpuinfo`` (or the text given); None when there is none or the flags cannot be read."""
    wanted = _BFLOAT16_FLAGS.get((machine or platform.machine()).lower(), ())
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):  # x86 names them flags, aarch64 features
            present = set(value.split())
            return next((flag for flag in wanted if flag in present), None)
    return None


def resolve_dtype(dtype: str, device: str) -> tuple[str, str]:
    """The dtype to run and why: ``auto`` is bfloat16 on a GPU (float16 on one without bfloat16) and on a CPU with
    native bfloat16 instructions, float32 on other CPUs; any other value is taken as asked."""
    if dtype != "auto":
        return dtype, f"{dtype} as asked"
    if device != "cpu":
        if device.startswith("cuda"):
            import torch

            if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
                return "float16", f"auto: float16, since this GPU ({device}) has no bfloat16"
        return "bfloat16", f"auto: bfloat16 on a GPU ({device})"
    flag = cpu_bfloat16_flag()
    if flag is not None:
        return "bfloat16", f"auto: bfloat16, since this CPU has native bfloat16 instructions ({flag})"
    return "float32", (
        "auto: float32, since this CPU has no native bfloat16 instructions (avx512_bf16, amx_bf16 or bf16), "
        "without which bfloat16 runs several times slower"
    )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine settings, named like vLLM's where they mean the same.

    The KV cache holds ``num_blocks`` blocks when given, else as many as fit ``kv_cache_memory``.
    ``sub_block_size`` (a divisor of ``block_size``; default: off) also reuses the part of a cached
    prefix that does not fill a whole block, by copying it.
    ``max_model_len`` defaults to the model's context length.
    ``disable_hybrid_kv_cache_manager`` (vLLM's option) keeps every layer's K/V in one KV cache group treated as
    full attention, sliding-window layers only masking their window; by default a model's sliding-window
    layers form groups of their own that give back the blocks that left their window.
    ``dtype`` ``auto`` (the default) is resolved here, once: bfloat16 on a GPU or a CPU with native bfloat16
    instructions, float32 otherwise (:func:`resolve_dtype`); afterwards ``dtype`` is the one that runs and
    ``dtype_reason`` says why, for the start-up log.
    ``quantization`` ``gguf`` (vLLM's name) runs a GGUF's quantized weights as int4 / int8 weight-only matmuls
    (``model.quantization``); ``none`` dequantizes them to ``dtype``.
    ``enforce_eager`` (vLLM's name) runs every step eagerly; False compiles the decode step with ``torch.compile``
    at start-up (``DecoderForCausalLM.compile_decode``): faster steps, but a minute or more of compiling on a
    CPU, hence eager by default.
    ``kv_events_config`` (a config, a dict of its fields or a JSON object string) publishes KV cache events.
    ``max_state_checkpoint_fraction``: for a model with recurrent layers (Qwen3.5, Granite 4.0-H, LFM2), the
    share of the KV cache memory its state checkpoints may take (one working state a running request comes
    out of the rest, beside the attention blocks); 0 keeps none, so no prefix of such a model hits.

    KV offload tiers behind the device cache, any combination, searched in this order:
    ``kv_offload_cpu`` (host memory, a size such as ``"8GiB"``), ``kv_offload_disk`` (``"PATH[:SIZE]"``,
    kept across restarts) and ``kv_offload_redis`` (``"redis://HOST:PORT[/DB][?capacity=SIZE]"``, shared by
    engines). ``kv_offload_mode`` decides how the host tier is filled: ``write_back`` (on eviction from the
    device) or ``write_through`` (as blocks are computed); disk and Redis are always written through.
    ``kv_offload_secret_file`` (else ``$PREFIXCACHE_KV_OFFLOAD_SECRET``) holds a deployment secret that
    authenticates disk and Redis records (HMAC-SHA256); every engine sharing a store needs the same one.
    ``kv_offload_min_priority`` (0-100, default 0: every block) drops blocks whose retention priority is below it
    instead of offloading them (TensorRT-LLM's semantics: only blocks at a priority are worth a tier).

    Retention directives (``prefixcache.core.retention``) are bounded by the operator: ``max_retained_fraction``
    is the share of the KV blocks that retained blocks (priority above the default) may hold, past which the
    oldest retained are demoted; ``max_retention_ttl_s`` the longest TTL (a longer one is clamped to it; the
    default is OpenAI's ``24h``); ``max_tenant_retained_fraction`` (None: no quota but the share) the share one
    tenant's retained blocks may hold. Without directives none of them changes anything. ``retention_rule``
    (None: off) names a rule of ``prefixcache.core.retention_rules`` that retains blocks from what requests share
    (``shared``: blocks more than one request reached), within the same bounds.

    ``scheduling_policy`` (vLLM's option) orders the waiting requests: ``fcfs`` (the default) first come first
    served; ``cache-aware`` the fewest uncached prompt tokens first, so a request that mostly hits the cache does
    not queue behind cold prefills, with aging so no request is passed over for more than a step's worth of
    tokens, and a cap on the cold prefill tokens that share a step with a short one (``engine.scheduler``).
    """

    model: str | None = None
    enable_prefix_caching: bool = True
    block_size: int = 16
    sub_block_size: int | None = None
    kv_cache_memory: str | int = "1GiB"
    num_blocks: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    device: str = "cpu"
    dtype: str = "auto"
    quantization: str = "none"
    enforce_eager: bool = True
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    eviction_policy: str = "lru"
    disable_hybrid_kv_cache_manager: bool = False
    max_state_checkpoint_fraction: float = 0.25
    seed: int = 0
    kv_events_config: KVEventsConfig | dict[str, Any] | str | None = None
    kv_offload_cpu: str | int | None = None
    kv_offload_disk: str | None = None
    kv_offload_redis: str | None = None
    kv_offload_mode: str = "write_back"
    kv_offload_secret_file: str | None = None
    kv_offload_min_priority: int = 0
    max_retained_fraction: float = DEFAULT_MAX_RETAINED_FRACTION
    max_retention_ttl_s: float = DEFAULT_MAX_RETENTION_TTL_S
    max_tenant_retained_fraction: float | None = None
    retention_rule: str | None = None
    scheduling_policy: str = "fcfs"
    dtype_reason: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.dtype == "auto" or not self.dtype_reason.startswith(f"auto: {self.dtype}"):
            # A copy (dataclasses.replace) of a resolved config keeps its reason unless its dtype changed.
            dtype, reason = resolve_dtype(self.dtype, self.device)
            object.__setattr__(self, "dtype", dtype)
            object.__setattr__(self, "dtype_reason", reason)
        object.__setattr__(self, "kv_events_config", KVEventsConfig.coerce(self.kv_events_config))
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.sub_block_size is not None and (self.sub_block_size <= 0 or self.block_size % self.sub_block_size):
            raise ValueError(f"sub_block_size must be a positive divisor of block_size, got {self.sub_block_size}")
        parse_memory(self.kv_cache_memory)
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        fraction = self.max_state_checkpoint_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0.0 <= fraction < 1.0:
            raise ValueError(f"max_state_checkpoint_fraction must be in [0, 1), got {fraction!r}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {', '.join(HASH_ALGOS)}, got {self.hash_algo!r}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, got {self.eviction_policy!r}"
            )
        check_bounds(self.max_retained_fraction, self.max_retention_ttl_s, self.max_tenant_retained_fraction)
        if self.retention_rule is not None and self.retention_rule not in RETENTION_RULES:
            raise ValueError(
                f"retention_rule must be one of {', '.join(RETENTION_RULES)} or None, got {self.retention_rule!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        self.offload_config()

    def offload_config(self) -> OffloadConfig:
        """The offload options, parsed (``prefixcache.offload.config.OffloadConfig``); ValueError when unreadable."""
        return OffloadConfig.parse(
            self.kv_offload_cpu,
            self.kv_offload_disk,
            self.kv_offload_redis,
            self.kv_offload_mode,
            self.kv_offload_secret_file,
            self.kv_offload_min_priority,
        )
