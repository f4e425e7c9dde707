"""A request body as the engine will see it: prompt token ids and the block hashes the index is keyed by.

Both kinds of backend tokenize alike, as vLLM does and with the server's own functions: a text prompt with
the tokenizer's special tokens unless the body says ``add_special_tokens: false``, token ids as given, chat
messages through the model's chat template with the generation prompt (and special tokens on top only with
``add_special_tokens: true``), and an Anthropic Messages body as the server's ``/v1/messages`` renders it
(``system`` first as a system message, then the messages, ``tools`` to the template, never special tokens on
top; ``cache_control`` marks retention, not tokens). The keys differ: for ``prefixcache serve`` backends
hashed with the engine's algorithm and seed, for content-keyed backends (vLLM) with the router's own content hash
(:mod:`prefixcache.router.blocks`). Both go through ``Request.hash_blocks`` (chained, with the cache salt and
LoRA keys), then into the integer form the KV events carry.

What one request costs here is bounded by the context where the router knows it (the ``max_model_len``
``prefixcache serve`` backends report): a prompt that cannot fit it is refused (``PromptTooLong``) before
it is hashed, and a text too long to fit it whatever its tokens before it is tokenized, so a client cannot
make the router tokenize megabytes that every backend would refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from jinja2 import TemplateError
from pydantic import ValidationError

from prefixcache.core import Request, hittable_blocks
from prefixcache.core.hashing import root_hash
from prefixcache.engine.chat_breakpoints import chat_text, chat_text_token_ids
from prefixcache.engine.input_processor import prompt_too_long, tokenize_prompt
from prefixcache.http.anthropic import MessagesRequest
from prefixcache.http.protocol import ChatMessage, ChatTool, adds_special_tokens
from prefixcache.router.backend_config import CacheConfig
from prefixcache.router.blocks import CONTENT_HASH_ALGO, CONTENT_ROOT
from prefixcache.router.wire import external_block_hash

# What the server generates when a completion request gives no max_tokens (OpenAI's default); also the
# router's guess for a chat request without a limit.
DEFAULT_OUTPUT_TOKENS = 16

# The three API shapes a prompt comes in: OpenAI's completions (``prompt``) and chat (``messages``), and
# Anthropic's Messages API (``system``, ``messages``, ``tools``).
PromptShape = Literal["completion", "chat", "messages"]
COMPLETION: PromptShape = "completion"
CHAT: PromptShape = "chat"
MESSAGES: PromptShape = "messages"


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
    ``max_model_len``: the backends' context, where known (None: not checked); ``max_text_chars`` is then the
    longest text that may still fit it (None also without a tokenizer, when only token ids can be read)."""

    def __init__(
        self,
        tokenizer: Any,
        hash_algo: str,
        root: bytes,
        block_size: int,
        keyed: bool = False,
        max_model_len: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.hash_algo = hash_algo
        self.root = root
        self.block_size = block_size
        self.keyed = keyed
        self.max_model_len = max_model_len
        known = max_model_len is not None and tokenizer is not None
        self.max_text_chars = max_model_len * longest_token_chars(tokenizer) if known else None

    @classmethod
    def for_engine(cls, tokenizer: Any, config: CacheConfig) -> PromptHasher:
        """Keys a ``prefixcache serve`` backend's events carry, from the hashing and the context it reports."""
        root = root_hash(config.hash_algo, config.hash_seed)
        return cls(
            tokenizer, config.hash_algo, root, config.block_size, keyed=config.keyed, max_model_len=config.max_model_len
        )

    @classmethod
    def by_content(cls, tokenizer: Any, block_size: int) -> PromptHasher:
        """The router's own content keys, for backends indexed by the tokens of their events."""
        return cls(tokenizer, CONTENT_HASH_ALGO, CONTENT_ROOT, block_size)

    def token_ids(self, body: dict[str, Any], shape: PromptShape) -> list[int] | None:
        """The prompt's token ids as the backend makes them, or None when it would refuse the body for another
        reason than its length (it answers that in its own words); raises PromptTooLong."""
        try:
            if shape != COMPLETION:
                conversation = _conversation(body, shape)
                if conversation is None:
                    return None
                messages, tools = conversation
                text = chat_text(self.tokenizer, messages, tools=tools)  # rendered first: what is tokenized
                self._check_text(text)
                special_tokens = shape == CHAT and adds_special_tokens(body, chat=True)
                token_ids = chat_text_token_ids(self.tokenizer, text, special_tokens)
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str | list):
                    return None
                if isinstance(prompt, str):
                    self._check_text(prompt)
                token_ids = tokenize_prompt(self.tokenizer, prompt, adds_special_tokens(body, chat=False))[1]
        except PromptTooLong:
            raise
        except (ValidationError, TemplateError, ValueError, TypeError):
            return None
        if self.max_model_len is not None and len(token_ids) > self.max_model_len:
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


def _conversation(
    body: dict[str, Any], shape: PromptShape
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None] | None:
    """A chat body's messages and tools as the chat template takes them (the server's own models read them),
    or None when the body has no messages; raises pydantic's ValidationError for a body the server refuses."""
    if shape == MESSAGES:
        request = MessagesRequest.model_validate(body)
        return request.conversation()[0], request.template_tools()
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    tools = [ChatTool.model_validate(t).template_dict() for t in body.get("tools") or ()] or None
    return [ChatMessage.model_validate(m).template_dict() for m in messages], tools


def requested_output_tokens(body: dict[str, Any], shape: PromptShape) -> int:
    """The most tokens the request may generate, for the router's load count."""
    for field in ("max_completion_tokens", "max_tokens") if shape == CHAT else ("max_tokens",):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return DEFAULT_OUTPUT_TOKENS


def cache_salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None


def prompt_cache_key(body: dict[str, Any]) -> str | None:
    """OpenAI's ``prompt_cache_key``: requests that share it are meant to share a cached prefix."""
    key = body.get("prompt_cache_key")
    return key if isinstance(key, str) and key else None
