"""KV offload tiers behind the device cache: host memory, local disk, Redis, and the connector that uses them.

Everything here except the worker side (``offload.worker``, torch) and the Redis tier (redis-py, loaded on
first use) imports without torch.
"""

from importlib import import_module
from typing import Any

from prefixcache.offload.disk import DiskStore
from prefixcache.offload.host import HostMemoryStore
from prefixcache.offload.record import KVLayout
from prefixcache.offload.store import KVStore, TierEventListener, TierStats

_LAZY = {"RedisStore": "prefixcache.offload.redis_store"}
__all__ = ["DiskStore", "HostMemoryStore", "KVLayout", "KVStore", "RedisStore", "TierEventListener", "TierStats"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'prefixcache.offload' has no attribute {name!r}")
