"""The OpenAI API as prefixcache serves it: request bodies (validated by pydantic), usage and errors.

Only types are checked here; value ranges (max_tokens, temperature, ...) are checked by
:class:`~prefixcache.engine.SamplingParams` and the engine, so the server and the offline API accept
exactly the same requests. Fields we do not support are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, StrictInt, field_validator, model_validator

from prefixcache.engine import RequestOutput, SamplingParams

MAX_CACHE_SALT_LEN = 128


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields common to both endpoints; ``cache_salt`` and ``ignore_eos`` are vLLM's extensions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("cache_salt")
    @classmethod
    def _valid_salt(cls, salt: str | None) -> str | None:
        """A salt is a tenant's cache key: an empty one would silently share, a huge one bloats every hash."""
        if salt is not None and (not salt or len(salt) > MAX_CACHE_SALT_LEN or not salt.isprintable()):
            raise ValueError(f"cache_salt must be 1 to {MAX_CACHE_SALT_LEN} printable characters")
        return salt

    @model_validator(mode="after")
    def _options_need_stream(self) -> _GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Raises ValueError for out-of-range values. ``top_k`` -1 (vLLM's "off") maps to the engine's 0."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            seed=self.seed,
            stop=self.stop or (),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_GenerationRequest):
    prompt: str | list[StrictInt]
    max_tokens: int | None = 16  # OpenAI's default for legacy completions


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextPart] | None = None

    def template_dict(self) -> dict[str, str]:
        """The message as chat templates expect it: content parts joined into one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("messages must not be empty")
        return messages


class CacheLookupRequest(_GenerationRequest):
    """``POST /v1/cache/lookup``: a completion body (``prompt``) or a chat body (``messages``), as sent to
    those endpoints; sampling fields are accepted and ignored. ``return_token_ids`` adds the prompt's token
    ids and each token's text to the answer (what ``prefixcache explain --base-url`` reads)."""

    prompt: str | list[StrictInt] | None = None
    messages: list[ChatMessage] | None = None
    return_token_ids: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> CacheLookupRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt (a completion body) or messages (a chat body)")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


def usage(output: RequestOutput) -> dict[str, Any]:
    """OpenAI's usage block; ``cached_tokens`` is what the prefix cache served of the prompt."""
    prompt_tokens = len(output.prompt_token_ids)
    completion_tokens = len(output.outputs[0].token_ids)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
    }


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
