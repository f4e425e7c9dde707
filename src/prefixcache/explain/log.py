"""Reading a request log: one JSON object a line, the bodies an OpenAI-compatible server receives.

A line is an OpenAI completion body (``prompt``: a string or a list of token ids), a chat body
(``messages``, turned into tokens by the model's chat template, as the server does), or an offline
prompt (``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``). ``cache_salt`` and ``lora_name`` name the
cache namespace a request reads; every other field is ignored. A line that cannot be read is reported
with its number and skipped, whatever it holds: JSON nested deeper than the parser goes, text with a lone
surrogate (not Unicode), token ids outside the model's vocabulary (refused as the server refuses them).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from pydantic import TypeAdapter, ValidationError

from prefixcache.engine.chat_breakpoints import chat_token_ids
from prefixcache.engine.input_processor import check_vocabulary, tokenize_prompt
from prefixcache.server.protocol import ChatMessage, Text

# The largest token id any server accepts (vLLM's bound; ids are int64 in the analysis).
MAX_TOKEN_ID = 2**63 - 1
_TEXT = TypeAdapter(Text)  # the server's own check of a string: valid Unicode

# Token ids to readable text: the tokenizer's decode, or the texts a server returned for each token.
Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True, slots=True)
class LoggedBody:
    """A log line that is a JSON object; ``line`` counts from 1."""

    line: int
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class LineError:
    line: int
    message: str


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request's prompt as the engine would see it, the cache namespace it reads, and for a chat body its
    messages as the template took them (to tell which message a prompt differs in)."""

    line: int
    token_ids: list[int]
    cache_salt: str | None = None
    lora_name: str | None = None
    messages: tuple[dict[str, str], ...] | None = None

    @property
    def namespace(self) -> tuple[str | None, str | None]:
        return self.cache_salt, self.lora_name


def read_log(path: Path) -> tuple[list[LoggedBody], list[LineError]]:
    """The JSON objects of a JSON-lines file; blank lines are skipped silently, bad ones reported."""
    bodies: list[LoggedBody] = []
    errors: list[LineError] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                body = json.loads(text)
            except json.JSONDecodeError as exc:
                errors.append(LineError(number, f"not JSON: {exc.msg} (column {exc.colno})"))
                continue
            except RecursionError:
                errors.append(LineError(number, "JSON nested too deeply to read"))
                continue
            if not isinstance(body, dict):
                errors.append(LineError(number, f"a JSON {type(body).__name__}, not a request object"))
                continue
            bodies.append(LoggedBody(number, body))
    return bodies, errors


def namespace_of(body: dict[str, Any]) -> tuple[str | None, str | None]:
    """``cache_salt`` and ``lora_name``; ValueError for a value the server would refuse."""
    names = []
    for field in ("cache_salt", "lora_name"):
        value = body.get(field)
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{field} must be a non-empty string")
        names.append(None if value is None else valid_text(value, field))
    return names[0], names[1]


def valid_text(text: str, field: str) -> str:
    """``text`` if the server would take it as a string (valid Unicode), else ValueError naming ``field``."""
    try:
        return _TEXT.validate_python(text)
    except ValidationError as exc:
        raise ValueError(f"{field}: {_first_error(exc)[1]}") from None


def _first_error(exc: ValidationError) -> tuple[str, str]:
    """Where pydantic's first error lies (field names and indexes, not its own validator names) and what it is."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or str(p).isidentifier())
    return where, first["msg"].removeprefix("Value error, ")


def chat_turns(body: dict[str, Any]) -> list[dict[str, str]] | None:
    """A chat body's messages, validated as the server validates them, in the shape chat templates take; None
    for a body without messages."""
    messages = body.get("messages")
    if messages is None:
        return None
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    turns = []
    for i, message in enumerate(messages):
        try:
            turns.append(ChatMessage.model_validate(message).template_dict())
        except ValidationError as exc:
            where, error = _first_error(exc)
            raise ValueError(f"bad message (messages.{i}.{where}: {error})") from None
    return turns


def token_ids_of(body: dict[str, Any], tokenizer: Any, vocab_size: int | None = None) -> list[int]:
    """The prompt's token ids: given ids, the encoded prompt text, or the templated conversation. With
    ``vocab_size``, ids outside the vocabulary are refused, as the server refuses them."""
    kinds = [k for k in ("prompt_token_ids", "messages") if body.get(k) is not None]
    if "prompt" in body and body["prompt"] is not None and "messages" in kinds:
        raise ValueError("both prompt and messages: is this a completion or a chat body?")
    if "prompt_token_ids" in kinds:
        ids = checked_token_ids(body["prompt_token_ids"], "prompt_token_ids")
    elif "messages" in kinds:
        ids = chat_token_ids(tokenizer, chat_turns(body))
    else:
        ids = _prompt_token_ids(body.get("prompt"), tokenizer)
    if vocab_size is not None:
        check_vocabulary(ids, vocab_size)
    return ids


def _prompt_token_ids(prompt: Any, tokenizer: Any) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        return tokenize_prompt(tokenizer, valid_text(prompt, "prompt"))[1]
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], str | list):
            raise ValueError("a list of prompts: explain takes one prompt per logged request")
        return checked_token_ids(prompt, "prompt")
    if prompt is None:
        raise ValueError("no prompt: expected prompt, prompt_token_ids or messages")
    raise ValueError(f"prompt must be a string or a list of token ids, not {type(prompt).__name__}")


def checked_token_ids(value: Any, field: str) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value)
    ):
        raise ValueError(f"{field} must be a non-empty list of token ids (integers in [0, 2^63))")
    return value


def tokenize_log(
    bodies: Iterable[LoggedBody], to_token_ids: Callable[[dict[str, Any]], list[int]]
) -> tuple[list[Prompt], list[LineError]]:
    """Every body as a Prompt; a body ``to_token_ids`` refuses (ValueError, a failing chat template)
    becomes a LineError."""
    prompts: list[Prompt] = []
    errors: list[LineError] = []
    for logged in bodies:
        try:
            salt, lora = namespace_of(logged.body)
            turns = chat_turns(logged.body)
            messages = None if turns is None else tuple(turns)
            prompts.append(Prompt(logged.line, to_token_ids(logged.body), salt, lora, messages))
        except (ValueError, TemplateError) as exc:
            errors.append(LineError(logged.line, str(exc)))
    return prompts, errors
