"""Model layer: a Llama-family decoder on a paged KV cache, and model loading.

Imports torch; the engine core must not import this package at import time.
"""

from prefixcache.model.attention import AttentionMetadata
from prefixcache.model.llama import LlamaForCausalLM, ModelConfig
from prefixcache.model.loader import DEFAULT_MODEL, LoadedModel, load_model

__all__ = ["DEFAULT_MODEL", "AttentionMetadata", "LlamaForCausalLM", "LoadedModel", "ModelConfig", "load_model"]
