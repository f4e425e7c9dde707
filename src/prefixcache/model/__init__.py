"""Model layer: one configurable decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 3, and the hybrids Qwen3.5,
Granite 4.0-H and LFM2 with their recurrent layers) on a paged KV cache and a state cache, and model loading.

Imports torch; the engine core must not import this package at import time.
"""

from prefixcache.model.attention import AttentionMetadata
from prefixcache.model.config import KVCacheGroup, ModelConfig
from prefixcache.model.decoder import DecoderForCausalLM
from prefixcache.model.loader import DEFAULT_MODEL, LoadedModel, load_model
from prefixcache.model.state import StateMetadata

__all__ = [
    "DEFAULT_MODEL",
    "AttentionMetadata",
    "DecoderForCausalLM",
    "KVCacheGroup",
    "LoadedModel",
    "ModelConfig",
    "StateMetadata",
    "load_model",
]
