"""Model layer: one configurable decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 3) on a paged KV cache, and
model loading.

Imports torch; the engine core must not import this package at import time.
"""

from prefixcache.model.attention import AttentionMetadata
from prefixcache.model.config import KVCacheGroup, ModelConfig
from prefixcache.model.decoder import DecoderForCausalLM
from prefixcache.model.loader import DEFAULT_MODEL, LoadedModel, load_model

__all__ = [
    "DEFAULT_MODEL",
    "AttentionMetadata",
    "DecoderForCausalLM",
    "KVCacheGroup",
    "LoadedModel",
    "ModelConfig",
    "load_model",
]
