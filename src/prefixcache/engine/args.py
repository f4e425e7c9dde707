"""Engine options on the command line, named like vLLM's flags, shared by every command that runs a model."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from prefixcache.config import EngineConfig
from prefixcache.core import HASH_ALGOS
from prefixcache.core.eviction import EVICTION_POLICIES
from prefixcache.kv_events.config import KVEventsConfig


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    if model_positional:
        parser.add_argument("model", nargs="?", default=None, help="HF checkpoint dir or .gguf (default: SmolLM2)")
    else:
        parser.add_argument("--model", default=None, help="HF checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    group = parser.add_argument_group("engine")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument(
        "--sub-block-size",
        type=int,
        default=None,
        help="also reuse partial-block prefixes at this granularity (a divisor of --block-size; default off)",
    )
    group.add_argument("--kv-cache-memory", default="1GiB", help="KV cache budget, e.g. 2GiB")
    group.add_argument(
        "--num-gpu-blocks-override",
        "--num-blocks",
        dest="num_blocks",
        type=int,
        default=None,
        help="exact number of KV blocks (overrides --kv-cache-memory)",
    )
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--prefix-caching-hash-algo", dest="hash_algo", default="sha256", choices=HASH_ALGOS)
    group.add_argument("--eviction-policy", default="lru", choices=sorted(EVICTION_POLICIES))
    group.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="one KV cache group for all layers: sliding-window layers keep every block and mask their window",
    )
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    group.add_argument("--device", default="cpu", help="cpu or cuda")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        metavar="JSON",
        help='publish KV cache events like vLLM, e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'',
    )
    offload = parser.add_argument_group("KV offload tiers (searched in this order after the device cache)")
    offload.add_argument("--kv-offload-cpu", default=None, metavar="SIZE", help="host memory tier, e.g. 8GiB")
    offload.add_argument(
        "--kv-offload-disk", default=None, metavar="PATH[:SIZE]", help="local disk tier, kept across restarts (10GiB)"
    )
    offload.add_argument(
        "--kv-offload-redis",
        default=None,
        metavar="URL",
        help="Redis tier shared by engines: redis://HOST:PORT[/DB][?capacity=SIZE] (4GiB)",
    )
    offload.add_argument(
        "--kv-offload-mode",
        default="write_back",
        choices=["write_back", "write_through"],
        help="fill the host tier on eviction from the device (default) or as blocks are computed",
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
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
