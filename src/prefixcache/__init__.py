"""prefixcache: an LLM inference engine built around automatic prefix caching.

``prefixcache.core`` (the cache manager) imports without torch; ``LLM`` and ``SamplingParams`` load
the engine on first use.
"""

from typing import Any

__all__ = ["LLM", "RetentionRange", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "RetentionRange":
        from prefixcache.core.retention import RetentionRange

        return RetentionRange
    if name in __all__:
        from prefixcache import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'prefixcache' has no attribute {name!r}")
