"""One frozen, validated engine configuration; components take plain arguments from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixcache.core import HASH_ALGOS
from prefixcache.core.eviction import EVICTION_POLICIES
from prefixcache.kv_events.config import KVEventsConfig
from prefixcache.offload.config import OffloadConfig
from prefixcache.units import parse_memory

__all__ = ["EngineConfig", "parse_memory"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine settings, named like vLLM's where they mean the same.

    The KV cache holds ``num_blocks`` blocks when given, else as many as fit ``kv_cache_memory``.
    ``sub_block_size`` (a divisor of ``block_size``; default: off) also reuses the part of a cached
    prefix that does not fill a whole block, by copying it.
    ``max_model_len`` defaults to the model's context length.
    ``kv_events_config`` (a config, a dict of its fields or a JSON object string) publishes KV cache events.

    KV offload tiers behind the device cache, any combination, searched in this order:
    ``kv_offload_cpu`` (host memory, a size such as ``"8GiB"``), ``kv_offload_disk`` (``"PATH[:SIZE]"``,
    kept across restarts) and ``kv_offload_redis`` (``"redis://HOST:PORT[/DB][?capacity=SIZE]"``, shared by
    engines). ``kv_offload_mode`` decides how the host tier is filled: ``write_back`` (on eviction from the
    device) or ``write_through`` (as blocks are computed); disk and Redis are always written through.
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
    dtype: str = "float32"
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    eviction_policy: str = "lru"
    seed: int = 0
    kv_events_config: KVEventsConfig | dict[str, Any] | str | None = None
    kv_offload_cpu: str | int | None = None
    kv_offload_disk: str | None = None
    kv_offload_redis: str | None = None
    kv_offload_mode: str = "write_back"

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_events_config", KVEventsConfig.coerce(self.kv_events_config))
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.sub_block_size is not None and (self.sub_block_size <= 0 or self.block_size % self.sub_block_size):
            raise ValueError(f"sub_block_size must be a positive divisor of block_size, got {self.sub_block_size}")
        parse_memory(self.kv_cache_memory)
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {', '.join(HASH_ALGOS)}, got {self.hash_algo!r}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, got {self.eviction_policy!r}"
            )
        self.offload_config()

    def offload_config(self) -> OffloadConfig:
        """The offload options, parsed (``prefixcache.offload.config.OffloadConfig``); ValueError when unreadable."""
        return OffloadConfig.parse(
            self.kv_offload_cpu, self.kv_offload_disk, self.kv_offload_redis, self.kv_offload_mode
        )
