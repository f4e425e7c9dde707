"""Engine options on the command line, named like vLLM's flags, shared by every command that runs a model.

Every default is the ``EngineConfig`` field's own default, read from the dataclass: one source of truth.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from typing import Any

from prefixcache.config import DTYPES, QUANTIZATIONS, SCHEDULING_POLICIES, EngineConfig
from prefixcache.core import HASH_ALGOS
from prefixcache.core.eviction import EVICTION_POLICIES
from prefixcache.core.retention_rules import RETENTION_RULES
from prefixcache.kv_events.config import KVEventsConfig
from prefixcache.offload.connector import OFFLOAD_MODES

_FIELDS = {f.name: f for f in fields(EngineConfig)}


def config_default(name: str) -> Any:
    """The default of the ``EngineConfig`` field ``name``."""
    default = _FIELDS[name].default
    if default is MISSING:
        raise KeyError(f"EngineConfig.{name} has no default")
    return default


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    model_help = "HF checkpoint dir or .gguf file (default: SmolLM2-135M-Instruct, bundled)"
    if model_positional:
        parser.add_argument("model", nargs="?", default=config_default("model"), help=model_help)
    else:
        parser.add_argument("--model", default=config_default("model"), help=model_help)
    group = parser.add_argument_group("engine")

    def option(*flags: str, field: str, **kwargs: Any) -> None:
        group.add_argument(*flags, dest=field, default=config_default(field), **kwargs)

    option("--block-size", field="block_size", type=int, help="tokens per KV block")
    option(
        "--sub-block-size",
        field="sub_block_size",
        type=int,
        help="also reuse partial-block prefixes at this granularity (a divisor of --block-size; default off)",
    )
    option("--kv-cache-memory", field="kv_cache_memory", help="KV cache budget, e.g. 2GiB")
    option(
        "--num-gpu-blocks-override",
        "--num-blocks",
        field="num_blocks",
        type=int,
        help="exact number of KV blocks (overrides --kv-cache-memory)",
    )
    option(
        "--enable-prefix-caching",
        field="enable_prefix_caching",
        action=argparse.BooleanOptionalAction,
        help="reuse the KV cache of shared prompt prefixes",
    )
    option("--prefix-caching-hash-algo", field="hash_algo", choices=HASH_ALGOS, help="block hash function")
    option(
        "--eviction-policy",
        field="eviction_policy",
        choices=sorted(EVICTION_POLICIES),
        help="which free block goes first",
    )
    option(
        "--disable-hybrid-kv-cache-manager",
        field="disable_hybrid_kv_cache_manager",
        action="store_true",
        help="one KV cache group for all layers: sliding-window layers keep every block and mask their window",
    )
    option(
        "--max-retained-fraction",
        field="max_retained_fraction",
        type=float,
        help="share of the KV blocks that retention directives may keep above the default priority",
    )
    option(
        "--retention-rule",
        field="retention_rule",
        choices=sorted(RETENTION_RULES),
        help="the engine's own retention from what requests share (shared: blocks more than one request reached); "
        "default none",
    )
    option(
        "--max-retention-ttl",
        field="max_retention_ttl_s",
        type=float,
        metavar="SECONDS",
        help="longest retention TTL a request may ask for; longer ones are clamped",
    )
    option(
        "--max-tenant-retained-fraction",
        field="max_tenant_retained_fraction",
        type=float,
        help="share of the KV blocks one API key's tenant may keep retained (default: only the overall share)",
    )
    option(
        "--max-state-checkpoint-fraction",
        field="max_state_checkpoint_fraction",
        type=float,
        help="share of --kv-cache-memory for recurrent-state checkpoints (models with recurrent layers)",
    )
    option(
        "--scheduling-policy",
        field="scheduling_policy",
        choices=SCHEDULING_POLICIES,
        help="order of waiting requests: fcfs, or cache-aware (fewest uncached prompt tokens first, with aging, "
        "and cold prefill capped in a step with a short one)",
    )
    option("--max-num-batched-tokens", field="max_num_batched_tokens", type=int, help="tokens computed per step")
    option("--max-num-seqs", field="max_num_seqs", type=int, help="requests running at once")
    option("--max-model-len", field="max_model_len", type=int, help="context length (default: the model's)")
    option(
        "--dtype",
        field="dtype",
        choices=DTYPES,
        help="weights and KV cache; auto: bfloat16 on a GPU or a CPU with native bfloat16 instructions "
        "(avx512_bf16, amx_bf16, aarch64 bf16), else float32",
    )
    option(
        "--quantization",
        "-q",
        field="quantization",
        choices=QUANTIZATIONS,
        help="gguf: run a GGUF's quantized weights as int4/int8 weight-only matmuls; none: dequantize to --dtype",
    )
    option(
        "--enforce-eager",
        field="enforce_eager",
        action=argparse.BooleanOptionalAction,
        help="run every step eagerly; --no-enforce-eager compiles the decode step with torch.compile at start-up "
        "(faster steps; on a CPU 1.5 minutes or more of compiling, seconds once inductor's cache holds it)",
    )
    option("--device", field="device", help="cpu or cuda")
    option("--seed", field="seed", type=int, help="sampling seed of requests that set none")
    option(
        "--kv-events-config",
        field="kv_events_config",
        type=_kv_events_config,
        metavar="JSON",
        help='publish KV cache events like vLLM, e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'',
    )
    offload = parser.add_argument_group("KV offload tiers (searched in this order after the device cache)")
    offload.add_argument(
        "--kv-offload-cpu", default=config_default("kv_offload_cpu"), metavar="SIZE", help="host memory tier, e.g. 8GiB"
    )
    offload.add_argument(
        "--kv-offload-disk",
        default=config_default("kv_offload_disk"),
        metavar="PATH[:SIZE]",
        help="local disk tier, kept across restarts (SIZE defaults to 10GiB)",
    )
    offload.add_argument(
        "--kv-offload-redis",
        default=config_default("kv_offload_redis"),
        metavar="URL",
        help="Redis tier shared by engines: redis://HOST:PORT[/DB][?capacity=SIZE] (capacity defaults to 4GiB)",
    )
    offload.add_argument(
        "--kv-offload-mode",
        default=config_default("kv_offload_mode"),
        choices=OFFLOAD_MODES,
        help="fill the host tier on eviction from the device (write_back) or as blocks are computed",
    )
    offload.add_argument(
        "--kv-offload-min-priority",
        type=int,
        default=config_default("kv_offload_min_priority"),
        metavar="N",
        help="drop, instead of offloading, blocks whose retention priority is below N (0-100; default 0: offload all)",
    )
    offload.add_argument(
        "--kv-offload-secret-file",
        default=None,
        metavar="PATH",
        help="deployment secret that authenticates disk and Redis records (HMAC-SHA256; "
        "else $PREFIXCACHE_KV_OFFLOAD_SECRET; without one, records are only checksummed)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed options that are ``EngineConfig`` fields, as keyword arguments for ``LLM`` / ``EngineConfig``."""
    return {name: getattr(args, name) for name in _FIELDS if hasattr(args, name)}
