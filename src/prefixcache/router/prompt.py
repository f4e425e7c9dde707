"""A request body as the engine will see it: prompt token ids and the block hashes the index is keyed by.

Tokenized by the server's own functions: a text prompt without special tokens, token ids as given,
chat messages through the model's chat template with the generation prompt. Hashed with the
engine's own code (``Request.hash_blocks``: chained, with the cache salt and LoRA keys), then put in
the integer form the KV events carry.

What one request costs here is bounded by the backends' context: a prompt that cannot fit it is refused
(``PromptTooLong``) before it is hashed, and a text too long to fit it whatever its tokens before it is
tokenized, so a client cannot make the router tokenize megabytes that every backend would refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from pydantic import ValidationError

from prefixcache.core import Request, hittable_blocks
from prefixcache.core.hashing import root_hash
from prefixcache.engine.input_processor import chat_token_ids, prompt_too_long, tokenize_prompt
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


class PromptTooLong(ValueError):
    """A prompt the backends' context cannot hold: the router answers 400 itself, as the server would."""


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token can stand for: the longest entry of the vocabulary.

    A vocabulary entry is written with at least one character per character it covers (byte-level entries
    with one per byte, SentencePiece ones with ``▁`` for a space, byte fallbacks as ``<0xNN>``), so a text
    longer than ``n`` times this has more than ``n`` tokens.
    """
    return max(map(len, tokenizer.get_vocab()), default=1)


class PromptHasher:
    """``keyed``: the backends salt each request by its API key's tenant, which the caller must add.

    ``max_text_chars``: the longest text that may still fit the context (None without a tokenizer, when only
    token ids can be read)."""

    def __init__(self, tokenizer: Any, config: CacheConfig) -> None:
        self.tokenizer = tokenizer
        self.keyed = config.keyed
        self.hash_algo = config.hash_algo
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.max_text_chars = None if tokenizer is None else config.max_model_len * longest_token_chars(tokenizer)
        self.root = root_hash(config.hash_algo, config.hash_seed)

    def token_ids(self, body: dict[str, Any], chat: bool) -> list[int] | None:
        """The prompt's token ids as the server makes them, or None when it would refuse the body for another
        reason than its length (it answers that in its own words); raises PromptTooLong."""
        try:
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list):
                    return None
                conversation = [ChatMessage.model_validate(m).template_dict() for m in messages]
                if self.max_text_chars is not None:  # rendered first: the template's text is what is tokenized
                    self._check_text(self.tokenizer.apply_chat_template(conversation, tokenize=False))
                token_ids = chat_token_ids(self.tokenizer, conversation)
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str | list):
                    return None
                if isinstance(prompt, str):
                    self._check_text(prompt)
                token_ids = tokenize_prompt(self.tokenizer, prompt)[1]
        except PromptTooLong:
            raise
        except (ValidationError, TemplateError, ValueError, TypeError):
            return None
        if len(token_ids) > self.max_model_len:
            raise PromptTooLong(prompt_too_long(len(token_ids), self.max_model_len))
        return token_ids

    def _check_text(self, text: str) -> None:
        """Refuses a text too long for the context whatever its tokens, without tokenizing it."""
        if self.max_text_chars is not None and len(text) > self.max_text_chars:
            raise PromptTooLong(prompt_too_long(f"more than {self.max_model_len}", self.max_model_len))

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
