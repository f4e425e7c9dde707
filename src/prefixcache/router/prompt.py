"""A request body as the engine will see it: prompt token ids and the block hashes the index is keyed by.

Tokenized exactly as the server does it: a text prompt without special tokens, token ids as given,
chat messages through the model's chat template with the generation prompt. Hashed with the
engine's own code (``Request.hash_blocks``: chained, with the cache salt and LoRA keys), then put in
the integer form the KV events carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from pydantic import ValidationError

from prefixcache.core import Request
from prefixcache.core.hashing import root_hash
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
    def __init__(self, tokenizer: Any, config: CacheConfig) -> None:
        self.tokenizer = tokenizer
        self.hash_algo = config.hash_algo
        self.block_size = config.block_size
        self.root = root_hash(config.hash_algo, config.hash_seed)

    def token_ids(self, body: dict[str, Any], chat: bool) -> list[int] | None:
        """The prompt's token ids, or None when the body has no prompt the server would accept."""
        if chat:
            return self._chat_token_ids(body.get("messages"))
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        return None

    def key(self, token_ids: list[int], cache_salt: str | None = None, lora_name: str | None = None) -> PromptKey:
        """Raises ValueError for ids the engine would refuse (empty, negative, too large)."""
        request = Request("route", token_ids, cache_salt=cache_salt, lora_name=lora_name)
        hittable = (len(token_ids) - 1) // self.block_size
        hashes = request.hash_blocks(self.hash_algo, self.root, 0, hittable, self.block_size)
        return PromptKey(len(token_ids), [external_block_hash(h) for h in hashes])

    def _chat_token_ids(self, messages: Any) -> list[int] | None:
        if not isinstance(messages, list) or not messages or not getattr(self.tokenizer, "chat_template", None):
            return None
        try:
            conversation = [ChatMessage.model_validate(m).template_dict() for m in messages]
            ids = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        except (ValidationError, TemplateError, ValueError, TypeError):
            return None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


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
