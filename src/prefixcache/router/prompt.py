"""A request body as the engine will see it: prompt token ids and the block hashes the index is keyed by.

Tokenized by the server's own functions: a text prompt without special tokens, token ids as given,
chat messages through the model's chat template with the generation prompt. Hashed with the
engine's own code (``Request.hash_blocks``: chained, with the cache salt and LoRA keys), then put in
the integer form the KV events carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from pydantic import ValidationError

from prefixcache.core import Request, hittable_blocks
from prefixcache.core.hashing import root_hash
from prefixcache.engine.input_processor import chat_token_ids, tokenize_prompt
from prefixcache.router.backend_config import CacheConfig
from prefixcache.router.wire import external_block_hash
from prefixcache.server.protocol import ChatMessage

# What the server generates when a completion request gives no max_tokens (OpenAI's default); also the
# router's guess for a chat request without a limit.
DEFAULT_OUTPUT_TOKENS = 16


@dataclass(frozen=True, slots=True)
class PromptKey:
    """``block_hashes`` are the blocks a cache lookup may return (all full blocks but the last token's)."""

    num_tokens: int
    block_hashes: list[int]


class PromptHasher:
    """``keyed``: the backends salt each request by its API key's tenant, which the caller must add."""

    def __init__(self, tokenizer: Any, config: CacheConfig) -> None:
        self.tokenizer = tokenizer
        self.keyed = config.keyed
        self.hash_algo = config.hash_algo
        self.block_size = config.block_size
        self.root = root_hash(config.hash_algo, config.hash_seed)

    def token_ids(self, body: dict[str, Any], chat: bool) -> list[int] | None:
        """The prompt's token ids as the server makes them, or None when it would refuse the body."""
        try:
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list):
                    return None
                conversation = [ChatMessage.model_validate(m).template_dict() for m in messages]
                return chat_token_ids(self.tokenizer, conversation)
            prompt = body.get("prompt")
            return tokenize_prompt(self.tokenizer, prompt)[1] if isinstance(prompt, str | list) else None
        except (ValidationError, TemplateError, ValueError, TypeError):
            return None

    def key(self, token_ids: list[int], cache_salt: str | None = None, lora_name: str | None = None) -> PromptKey:
        """Raises ValueError for ids the engine would refuse (empty, negative, too large)."""
        request = Request("route", token_ids, cache_salt=cache_salt, lora_name=lora_name)
        hittable = hittable_blocks(len(token_ids), self.block_size)
        hashes = request.hash_blocks(self.hash_algo, self.root, 0, hittable, self.block_size)
        return PromptKey(len(token_ids), [external_block_hash(h) for h in hashes])


def requested_output_tokens(body: dict[str, Any], chat: bool) -> int:
    """The most tokens the request may generate, for the router's load count."""
    for field in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return DEFAULT_OUTPUT_TOKENS


def cache_salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None
