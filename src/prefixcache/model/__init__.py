"""Model layer: a configurable decoder (Llama, Mistral, Qwen2) on a paged KV cache, and model loading.

Imports torch; the engine core must not import this package at import time.
"""

from prefixcache.model.attention import AttentionMetadata
from prefixcache.model.decoder import DecoderForCausalLM, ModelConfig
from prefixcache.model.loader import DEFAULT_MODEL, LoadedModel, load_model

__all__ = ["DEFAULT_MODEL", "AttentionMetadata", "DecoderForCausalLM", "LoadedModel", "ModelConfig", "load_model"]
