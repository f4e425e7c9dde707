"""What ``prefixcache serve`` says once its engine is up: the model, how it computes, its KV cache, and what
the cache shares beyond the process (offload tiers, KV events), read from the core's handshake and the
config, so a misconfiguration shows in the first lines of the log rather than in the first benchmark."""

from __future__ import annotations

from urllib.parse import urlsplit

from prefixcache.config import EngineConfig
from prefixcache.engine.messages import EngineInfo, EngineStats


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"


def _capped(info: EngineInfo) -> str:
    """Said when the KV cache holds less than one request of the whole context: what requests may grow to."""
    if info.kv_capacity_tokens >= info.max_model_len:
        return ""
    return f", less than the context: requests up to {info.kv_capacity_tokens:,} tokens"


def startup_lines(info: EngineInfo, config: EngineConfig, stats: EngineStats | None = None) -> list[str]:
    """One line each: model, KV cache and prefix caching, offload tiers, KV events. ``stats``, the core's first,
    says which tiers are live: one asked for that could not open (a disk directory it may not write, a Redis
    down) is listed as unavailable, and none runs while prefix caching is off."""
    caching = f"on ({info.hash_algo})" if info.enable_prefix_caching else "off"
    offload = config.offload_config()
    asked = []
    if offload.cpu_bytes is not None:
        asked.append(("CPU", f"CPU {_size(offload.cpu_bytes)} ({offload.mode})"))
    if offload.disk_path is not None:
        asked.append(("DISK", f"DISK {offload.disk_path} {_size(offload.disk_bytes)}"))
    if offload.redis_url is not None:
        where = urlsplit(offload.redis_url)  # host and port only: the URL may hold a password
        asked.append(("REDIS", f"REDIS {where.hostname}:{where.port or 6379} {_size(offload.redis_bytes)}"))
    live = {tier.medium: tier.available for tier in stats.kv_offload} if stats is not None else None
    tiers = []
    for medium, described in asked:
        if live is not None and medium not in live:
            described += " (off: prefix caching is off)"
        elif live is not None and not live[medium]:
            described += " (UNAVAILABLE: see the error above; serving without it)"
        tiers.append(described)
    events = config.kv_events_config
    if events is not None and events.enable_kv_cache_events and events.publisher == "zmq":
        replay = f", replay on {events.replay_endpoint}" if events.replay_endpoint else ""
        how = "bound at" if events.binds_endpoint else "connecting to"  # the core's log says who can reach it
        published = f"published, {how} {events.endpoint}{replay}"
    else:
        published = "off"
    return [
        f"model {info.model_name} ({info.architecture}) from {config.model}: {info.dtype} on {info.device}, "
        f"context {info.max_model_len:,} tokens",
        f"KV cache: {info.num_blocks:,} blocks of {info.block_size} tokens ({info.kv_capacity_tokens:,} tokens, "
        f"{_size(info.kv_cache_bytes)}){_capped(info)}; prefix caching {caching}",
        f"offload tiers: {', '.join(tiers) or 'none'}",
        f"KV events: {published}",
    ]
