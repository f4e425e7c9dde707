"""What a backend reports at ``GET /v1/cache/config``, and whether the router can predict its cache from it.

The router hashes prompts itself, so every backend must hash exactly as it does: same model (same
tokens), block size, hash algorithm and seed, and the same salting (``tenant_salt``: whether each API key
is a tenant). A backend that differs is refused. A backend older than ``tenant_salt`` reports none: not keyed.

Its KV cache groups (``kv_cache_groups``) are its own: backends of one model may group its layers differently
(one with the hybrid manager disabled). A backend older than them reports none: the router learns them from
its events.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import msgspec

from prefixcache.core.kv_cache_groups import KVCacheGroupSpec, spec_of_kind
from prefixcache.core.tenant_salt import SALT_BY_API_KEY

CACHE_CONFIG_PATH = "/v1/cache/config"
_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")


class KVEventsEndpoints(msgspec.Struct, frozen=True):
    """Where the backend publishes KV events, as configured there (a bind address like ``tcp://*:5557``)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class KVCacheGroupInfo(msgspec.Struct, frozen=True):
    """One KV cache group as the backend describes it (the shape vLLM gives its event consumers)."""

    group_idx: int
    kind: str
    block_size: int
    sliding_window: int | None = None


class CacheConfig(msgspec.Struct, frozen=True):
    model: str
    max_model_len: int
    block_size: int
    hash_algo: str
    hash_seed: str
    enable_prefix_caching: bool
    kv_events: KVEventsEndpoints | None = None
    tenant_salt: str | None = None
    kv_cache_groups: tuple[KVCacheGroupInfo, ...] = ()

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        for position, group in enumerate(self.kv_cache_groups):
            if group.group_idx != position or group.block_size != self.block_size:
                raise ValueError(
                    f"kv_cache_groups[{position}] is group {group.group_idx} of blocks of {group.block_size} tokens, "
                    f"not group {position} of {self.block_size}"
                )
            spec_of_kind(group.kind, group.sliding_window)  # ValueError for a sliding group without its window
        if self.tenant_salt not in (None, SALT_BY_API_KEY):
            raise ValueError(
                f"tenant_salt {self.tenant_salt!r} is unknown to this router (it knows {SALT_BY_API_KEY!r})"
            )

    @property
    def group_specs(self) -> tuple[KVCacheGroupSpec | None, ...]:
        """Each group's spec in group order; None for a kind whose hit the router cannot model."""
        return tuple(spec_of_kind(group.kind, group.sliding_window) for group in self.kv_cache_groups)

    @property
    def keyed(self) -> bool:
        """Whether the backend salts each request with its API key's tenant salt."""
        return self.tenant_salt == SALT_BY_API_KEY


_decoder = msgspec.json.Decoder(CacheConfig)


def parse_cache_config(content: bytes) -> CacheConfig:
    """Raises ValueError naming the bad field for a body that is not a cache config."""
    try:
        return _decoder.decode(content)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ValueError(f"not a cache config: {exc}") from None


def hashing_mismatch(reference: CacheConfig, other: CacheConfig) -> str | None:
    """The first setting that makes ``other`` hash prompts differently from ``reference``, or None."""
    for field in ("model", "block_size", "hash_algo", "hash_seed", "tenant_salt"):
        mine, theirs = getattr(reference, field), getattr(other, field)
        if mine != theirs:
            return f"{field} is {theirs!r}, the other backends use {mine!r}"
    return None


def connect_address(endpoint: str, backend_url: str) -> str | None:
    """A ZeroMQ address to connect to for ``endpoint`` as the backend configured it.

    A wildcard bind (``tcp://*:5557``) is reached at the backend's own host; ``inproc://`` is only
    reachable inside the backend's process, so None.
    """
    scheme, _, address = endpoint.partition("://")
    if scheme == "inproc":
        return None
    if scheme != "tcp":
        return endpoint
    host, _, port = address.rpartition(":")
    if host in _WILDCARD_HOSTS:
        backend_host = urlsplit(backend_url).hostname or "127.0.0.1"
        host = f"[{backend_host}]" if ":" in backend_host else backend_host
    return f"tcp://{host}:{port}"
