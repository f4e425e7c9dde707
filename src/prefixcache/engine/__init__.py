"""The inference engine: scheduler, model runner, sampler and the offline ``LLM`` API.

Names load on first use, so torch-free parts (``sampling_params``, ``args``) import without torch.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "LLM": "prefixcache.engine.llm",
    "LLMEngine": "prefixcache.engine.llm_engine",
    "EngineCore": "prefixcache.engine.core",
    "EngineStats": "prefixcache.engine.messages",
    "CompletionOutput": "prefixcache.engine.outputs",
    "RequestOutput": "prefixcache.engine.outputs",
    "SamplingParams": "prefixcache.engine.sampling_params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'prefixcache.engine' has no attribute {name!r}")
