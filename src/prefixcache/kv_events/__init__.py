"""KV cache events in vLLM's wire format: collected from the block pool, published over ZeroMQ.

Names load on first use, so ``KVEventsConfig`` (command line, ``EngineConfig``) imports without zmq or msgspec.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "KVEventsConfig": "prefixcache.kv_events.config",
    "KVEventCollector": "prefixcache.kv_events.collector",
    "KVEventSink": "prefixcache.kv_events.sink",
    "NullEventPublisher": "prefixcache.kv_events.publisher",
    "ZmqEventPublisher": "prefixcache.kv_events.publisher",
    "make_publisher": "prefixcache.kv_events.publisher",
    "AllBlocksCleared": "prefixcache.kv_events.events",
    "BlockRemoved": "prefixcache.kv_events.events",
    "BlockStored": "prefixcache.kv_events.events",
    "KVEventBatch": "prefixcache.kv_events.events",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'prefixcache.kv_events' has no attribute {name!r}")
