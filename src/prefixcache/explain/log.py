"""Reading a request log: one JSON object a line, the bodies an OpenAI-compatible server receives.

A line is an OpenAI completion body (``prompt``: a string or a list of token ids), a chat body (``messages``, turned
into tokens by the model's chat template, as the server does), an Anthropic Messages body (told by its top-level
``system`` or ``cache_control`` or a tool's ``input_schema``; read as the chat body the server runs it as, with
``http/anthropic.py``'s conversion), or an offline prompt (``{"prompt": ...}`` /
``{"prompt_token_ids": [...]}``). ``cache_salt`` and ``lora_name`` name the cache namespace a request reads;
``add_special_tokens`` says whether a text gets the tokenizer's special tokens (the server's default: a completion's
text does, a chat adds none beyond its template). Retention directives are read as the server reads them
(``http/retention.py``): ``cache_control`` breakpoints on messages, content parts and ``tools`` (placed by the
chat template, which also renders the tools), ``retention`` token ranges and ``prompt_cache_retention``. A
``timestamp`` (seconds, any origin, or an ISO 8601 string) times the replay's TTLs. Every other field is ignored. A
line that cannot be read is reported with its number and skipped, whatever it holds: JSON nested deeper than the
parser goes, text with a lone surrogate (not Unicode), token ids outside the model's vocabulary, a directive the
server would refuse (a fifth breakpoint, a priority out of range, a range past the prompt).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from pydantic import TypeAdapter, ValidationError

from prefixcache.core.retention import RetentionRange, check_retention
from prefixcache.engine.chat_breakpoints import Breakpoint
from prefixcache.engine.input_processor import check_vocabulary, hinted_chat_prompt, tokenize_prompt
from prefixcache.http.anthropic import MessagesConversation
from prefixcache.http.protocol import ChatMessage, ChatTool, Text, adds_special_tokens, conversation_breakpoints
from prefixcache.http.retention import (
    PromptCacheRetention,
    TokenRangeRetention,
    breakpoint_ranges,
    check_breakpoint_count,
    request_ranges,
)

# The largest token id any server accepts (vLLM's bound; ids are int64 in the analysis).
MAX_TOKEN_ID = 2**63 - 1
_TEXT = TypeAdapter(Text)  # the server's own check of a string: valid Unicode
_RETENTION = TypeAdapter(list[TokenRangeRetention] | None)
_PROMPT_CACHE_RETENTION = TypeAdapter(PromptCacheRetention | None)

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
    messages as the template took them (to tell which message a prompt differs in). ``retention``: the ranges
    its directives ask for, as the server would give them to the engine; ``timestamp``: when it was sent
    (seconds), None when the line says not; ``system_end``: the token position right after its leading system
    messages (where ``explain --breakpoint system`` puts a breakpoint), None when not located or it has none;
    ``checkpoint_hints``: where a chat's messages end, for a model with recurrent layers (the engine checkpoints
    its state there)."""

    line: int
    token_ids: list[int]
    cache_salt: str | None = None
    lora_name: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    retention: tuple[RetentionRange, ...] = ()
    timestamp: float | None = None
    system_end: int | None = None
    checkpoint_hints: tuple[int, ...] = ()

    @property
    def namespace(self) -> tuple[str | None, str | None]:
        return self.cache_salt, self.lora_name


@dataclass(frozen=True, slots=True)
class Tokenized:
    """A body's prompt token ids, the ranges of its ``cache_control`` breakpoints (their positions are the chat
    template's) and, when asked, the position after its leading system messages and its messages' ends (the
    checkpoint hints of a model with recurrent layers)."""

    token_ids: list[int]
    breakpoints: tuple[RetentionRange, ...] = ()
    system_end: int | None = None
    checkpoint_hints: tuple[int, ...] = ()


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
            try:
                bodies.append(LoggedBody(number, as_chat_body(body)))
            except ValueError as exc:
                errors.append(LineError(number, str(exc)))
    return bodies, errors


def is_messages_body(body: dict[str, Any]) -> bool:
    """Whether a body is one only ``/v1/messages`` takes: a top-level ``system`` or ``cache_control``, or a tool
    with an ``input_schema``. A Messages body without any of them is a chat body too, one that renders the same."""
    tools = body.get("tools")
    marked_tools = isinstance(tools, list) and any(isinstance(tool, dict) and "input_schema" in tool for tool in tools)
    return body.get("system") is not None or body.get("cache_control") is not None or marked_tools


def as_chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/messages`` body as the chat body its conversation runs as (``MessagesConversation``, the server's
    own conversion), its other fields kept; any other body as it is. ValueError naming the field the server
    would refuse."""
    if not is_messages_body(body):
        return body
    fields = set(MessagesConversation.model_fields)
    try:
        conversation = MessagesConversation.model_validate({k: v for k, v in body.items() if k in fields})
    except ValidationError as exc:
        field, error = _first_error(exc)
        raise ValueError(f"a /v1/messages body the server would refuse ({field or 'body'}: {error})") from None
    return {**{k: v for k, v in body.items() if k not in fields}, **conversation.chat_body()}


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
    """Where pydantic's telling error lies (field names and indexes, not its own validator names) and what it is:
    our own checks' first, else the one deepest in the body (of a union, the member that got furthest: a bad
    ``ttl`` in a text block, not "system: Input should be a valid string")."""
    errors = exc.errors()
    first = next((e for e in errors if e["type"] == "value_error"), max(errors, key=lambda e: len(e["loc"])))
    where = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or str(p).isidentifier())
    return where, first["msg"].removeprefix("Value error, ")


def chat_messages(body: dict[str, Any]) -> list[ChatMessage] | None:
    """A chat body's messages, validated as the server validates them; None for a body without messages."""
    messages = body.get("messages")
    if messages is None:
        return None
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    return [_validated(ChatMessage, message, f"bad message (messages.{i}") for i, message in enumerate(messages)]


def _validated(model: Any, value: Any, where: str) -> Any:
    """``value`` as the pydantic ``model``; ValueError ``where.FIELD: error)`` as the server would refuse it."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        field, error = _first_error(exc)
        raise ValueError(f"{where}.{field}: {error})" if field else f"{where}: {error})") from None


def chat_turns(body: dict[str, Any]) -> list[dict[str, str]] | None:
    """A chat body's messages, validated as the server validates them, in the shape chat templates take; None
    for a body without messages."""
    messages = chat_messages(body)
    return None if messages is None else [message.template_dict() for message in messages]


def tokenize_body(
    body: dict[str, Any],
    tokenizer: Any,
    vocab_size: int | None = None,
    locate_system: bool = False,
    message_ends: bool = False,
) -> Tokenized:
    """The prompt's token ids (given ids, the encoded prompt text, or the templated conversation with its tools)
    and its breakpoints' ranges. With ``vocab_size``, ids outside the vocabulary are refused, as the server
    refuses them; with ``locate_system``, a chat's position after its leading system messages is found too; with
    ``message_ends`` (a model with recurrent layers), where its messages end, as the server's checkpoint hints."""
    kinds = [k for k in ("prompt_token_ids", "messages") if body.get(k) is not None]
    if "prompt" in body and body["prompt"] is not None and "messages" in kinds:
        raise ValueError("both prompt and messages: is this a completion or a chat body?")
    if "prompt_token_ids" in kinds:
        tokenized = Tokenized(checked_token_ids(body["prompt_token_ids"], "prompt_token_ids"))
    elif "messages" in kinds:
        tokenized = _chat_tokens(body, tokenizer, locate_system, message_ends)
    else:
        tokenized = Tokenized(_prompt_token_ids(body.get("prompt"), tokenizer, adds_special_tokens(body, chat=False)))
    if vocab_size is not None:
        check_vocabulary(tokenized.token_ids, vocab_size)
    return tokenized


def _chat_tokens(body: dict[str, Any], tokenizer: Any, locate_system: bool, message_ends: bool) -> Tokenized:
    """The conversation through the chat template, as the server's chat endpoint renders it, with the token
    positions of its breakpoints (tools first, then the messages) and, if asked, of its system messages' end and
    of each message's end."""
    messages = chat_messages(body)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools must be a list")
    tools = [_validated(ChatTool, tool, f"bad tool (tools.{i}") for i, tool in enumerate(tools or ())]
    marks = conversation_breakpoints(messages, tools)
    check_breakpoint_count(len(marks))
    points = [point for point, _ in marks]
    num_system = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    locate = locate_system and num_system > 0
    if locate:
        points.append(Breakpoint("message", num_system - 1))
    template_tools = [tool.template_dict() for tool in tools] or None
    ids, positions, hints = hinted_chat_prompt(
        tokenizer,
        [m.template_dict() for m in messages],
        template_tools,
        points,
        add_generation_prompt=True,
        add_special_tokens=adds_special_tokens(body, chat=True),
        hint_message_ends=message_ends,
    )
    system_end = positions.pop() if locate else None
    return Tokenized(ids, tuple(breakpoint_ranges(positions, [c for _, c in marks])), system_end, tuple(hints))


def body_ranges(body: dict[str, Any]) -> list[RetentionRange]:
    """The ranges of a body's ``retention`` and ``prompt_cache_retention``, validated as the server does (no
    tokenizer needed); ValueError naming the field."""
    retention = _validated_field(_RETENTION, body.get("retention"), "retention")
    prompt_cache_retention = _validated_field(
        _PROMPT_CACHE_RETENTION, body.get("prompt_cache_retention"), "prompt_cache_retention"
    )
    return request_ranges(retention, prompt_cache_retention)


def _validated_field(adapter: TypeAdapter, value: Any, field: str) -> Any:
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        where, error = _first_error(exc)
        raise ValueError(f"{field}{'.' + where if where else ''}: {error}") from None


def timestamp_of(body: dict[str, Any]) -> float | None:
    """The body's ``timestamp`` in seconds (a number, or an ISO 8601 string, read as UTC without a zone); None
    when it has none; ValueError for anything else."""
    value = body.get("timestamp")
    if value is None:
        return None
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(f"timestamp {value[:40]!r} is neither seconds nor an ISO 8601 time") from None
        return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError("timestamp must be a number of seconds or an ISO 8601 time")
    return float(value)


def prompt_of(logged: LoggedBody, tokenized: Tokenized, messages: tuple[dict[str, str], ...] | None) -> Prompt:
    """A logged body as a Prompt: its namespace, directives (breakpoints, then the body's ranges, checked against
    the prompt as the server checks them) and timestamp; ValueError for one the server would refuse."""
    body = logged.body
    salt, lora = namespace_of(body)
    retention = check_retention([*tokenized.breakpoints, *body_ranges(body)], len(tokenized.token_ids))
    return Prompt(
        logged.line,
        tokenized.token_ids,
        salt,
        lora,
        messages,
        retention=retention,
        timestamp=timestamp_of(body),
        system_end=tokenized.system_end,
        checkpoint_hints=tokenized.checkpoint_hints,
    )


def _prompt_token_ids(prompt: Any, tokenizer: Any, add_special_tokens: bool) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        return tokenize_prompt(tokenizer, valid_text(prompt, "prompt"), add_special_tokens)[1]
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
    bodies: Iterable[LoggedBody], to_tokens: Callable[[dict[str, Any]], Tokenized]
) -> tuple[list[Prompt], list[LineError]]:
    """Every body as a Prompt; a body ``to_tokens`` refuses (ValueError, a failing chat template), or whose
    directives or timestamp the server would refuse, becomes a LineError."""
    prompts: list[Prompt] = []
    errors: list[LineError] = []
    for logged in bodies:
        try:
            turns = chat_turns(logged.body)
            messages = None if turns is None else tuple(turns)
            prompts.append(prompt_of(logged, to_tokens(logged.body), messages))
        except (ValueError, TemplateError) as exc:
            errors.append(LineError(logged.line, str(exc)))
    return prompts, errors
