"""Reading a request log: one JSON object a line, the bodies an OpenAI-compatible server receives.

A line is an OpenAI completion body (``prompt``: a string or a list of token ids), a chat body
(``messages``, turned into tokens by the model's chat template, as the server does), or an offline
prompt (``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``). ``cache_salt`` and ``lora_name`` name the
cache namespace a request reads; every other field is ignored. A line that cannot be read is reported
with its number and skipped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from pydantic import ValidationError

from prefixcache.engine.input_processor import chat_token_ids, tokenize_prompt
from prefixcache.server.protocol import ChatMessage

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
    """One request's prompt as the engine would see it, and the cache namespace it reads."""

    line: int
    token_ids: list[int]
    cache_salt: str | None = None
    lora_name: str | None = None

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
        names.append(value)
    return names[0], names[1]


def token_ids_of(body: dict[str, Any], tokenizer: Any) -> list[int]:
    """The prompt's token ids: given ids, the encoded prompt text, or the templated conversation."""
    kinds = [k for k in ("prompt_token_ids", "messages") if body.get(k) is not None]
    if "prompt" in body and body["prompt"] is not None and "messages" in kinds:
        raise ValueError("both prompt and messages: is this a completion or a chat body?")
    if "prompt_token_ids" in kinds:
        return checked_token_ids(body["prompt_token_ids"], "prompt_token_ids")
    if "messages" in kinds:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        try:
            turns = [ChatMessage.model_validate(m).template_dict() for m in messages]
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"bad message ({where}: {first['msg']})") from None
        return chat_token_ids(tokenizer, turns)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        return tokenize_prompt(tokenizer, prompt)[1]
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
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        raise ValueError(f"{field} must be a non-empty list of token ids (integers >= 0)")
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
            prompts.append(Prompt(logged.line, to_token_ids(logged.body), salt, lora))
        except (ValueError, TemplateError) as exc:
            errors.append(LineError(logged.line, str(exc)))
    return prompts, errors
