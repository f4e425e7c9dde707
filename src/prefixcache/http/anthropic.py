"""Anthropic's Messages API as prefixcache serves it (``POST /v1/messages``): the request body, the message and
its usage, the streamed events, and Anthropic's error shape.

Text only: content is a string or text blocks, ``system`` a string or text blocks, ``tools`` go to the chat
template (a call the model writes comes back as its text). ``cache_control`` on a tool, a system block or a
message's block is a retention breakpoint (``http/retention.py``). Usage follows Anthropic's accounting:
``cache_creation_input_tokens`` are prompt tokens this request wrote into retained blocks,
``cache_read_input_tokens`` the ones it read from them, and ``input_tokens`` the rest of the prompt, so the three
add up to the prompt; ``cache_creation`` splits the written ones by the TTL their blocks are kept for (a TTL
longer than 5 minutes, such as a 1h cut to the operator's largest, counts as 1h).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictInt, field_validator, model_validator
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixcache.engine import RequestOutput, SamplingParams
from prefixcache.engine.chat_breakpoints import Breakpoint
from prefixcache.http.protocol import Text
from prefixcache.http.retention import CacheControl, check_breakpoint_count, part_breakpoints, written_by_ttl

MESSAGES_PATH = "/v1/messages"
# Anthropic's error type for each status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Body):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None


def _joined(content: str | list[TextBlock], index: int) -> tuple[str, list[tuple[Breakpoint, CacheControl]]]:
    """A content as the one string templates take, and its breakpoints (as message ``index`` of the template's
    conversation)."""
    if isinstance(content, str):
        return content, []
    return "".join(block.text for block in content), part_breakpoints(content, index)


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    content: Text | list[TextBlock]


class Tool(_Body):
    """A client tool: its definition goes to the chat template in the function shape templates read."""

    type: Literal["custom"] | None = None
    name: Text
    description: Text | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None

    def template_dict(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class Metadata(_Body):
    user_id: Text | None = None


class CountTokensRequest(_Body):
    """The conversation of a Messages request (the body of ``POST /v1/messages/count_tokens``): the last message
    is the user's (a final assistant message, Anthropic's prefill, is not implemented). A top-level
    ``cache_control`` marks the last block of the last message, as Anthropic's automatic caching does."""

    model: Text
    messages: list[InputMessage]
    system: Text | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    cache_control: CacheControl | None = None

    @field_validator("messages")
    @classmethod
    def _ends_with_user(cls, messages: list[InputMessage]) -> list[InputMessage]:
        if not messages:
            raise ValueError("messages must not be empty")
        if messages[-1].role != "user":
            raise ValueError("the last message must be the user's (continuing an assistant message is not implemented)")
        return messages

    @model_validator(mode="after")
    def _bounded_breakpoints(self) -> CountTokensRequest:
        check_breakpoint_count(len(self.conversation()[1]))
        return self

    def conversation(self) -> tuple[list[dict[str, str]], list[tuple[Breakpoint, CacheControl]]]:
        """The messages as the chat template takes them (``system`` first, as a system message) and every
        breakpoint: tools first, then system, then the messages, Anthropic's order of the prompt."""
        marks = [(Breakpoint("tool", i), t.cache_control) for i, t in enumerate(self.tools or ()) if t.cache_control]
        messages = []
        if self.system is not None:
            text, system_marks = _joined(self.system, 0)
            messages.append({"role": "system", "content": text})
            marks.extend(system_marks)
        for message in self.messages:
            text, message_marks = _joined(message.content, len(messages))
            messages.append({"role": message.role, "content": text})
            marks.extend(message_marks)
        if self.cache_control is not None:
            last = len(messages) - 1
            marks.append((Breakpoint("content", last, len(messages[last]["content"])), self.cache_control))
        return messages, marks

    def template_tools(self) -> list[dict[str, Any]] | None:
        return None if not self.tools else [tool.template_dict() for tool in self.tools]


class MessagesRequest(CountTokensRequest):
    """The body of ``POST /v1/messages``: ``max_tokens`` is required, as in Anthropic's API."""

    max_tokens: StrictInt
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    stop_sequences: list[Text] | None = None
    stream: bool = False
    metadata: Metadata | None = None

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, max_tokens: int) -> int:
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        return max_tokens

    def sampling_params(self) -> SamplingParams:
        """Raises InvalidParameter for out-of-range values (Anthropic's defaults: temperature 1, no top-p/k)."""
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            stop=tuple(self.stop_sequences or ()),
        )


def stop_reason(output: RequestOutput) -> tuple[str | None, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of a finished output (None, None while it runs)."""
    completion = output.outputs[0]
    if not output.finished:
        return None, None
    if completion.finish_reason == "length":
        return "max_tokens", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def message_usage(output: RequestOutput) -> dict[str, Any]:
    """Anthropic's usage of one output: the prompt split into read from / written to retained blocks and the rest."""
    written = output.num_retained_written_tokens
    read = output.num_retained_read_tokens
    written_5m, written_1h = written_by_ttl(output.num_retained_written_tokens_by_ttl)
    counts: dict[str, Any] = {
        "input_tokens": len(output.prompt_token_ids) - written - read,
        "output_tokens": len(output.outputs[0].token_ids),
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": read,
        "cache_creation": {"ephemeral_5m_input_tokens": written_5m, "ephemeral_1h_input_tokens": written_1h},
    }
    if output.retention_clamped is not None:
        counts["retention_clamped"] = output.retention_clamped
    return counts


def message(message_id: str, model: str, output: RequestOutput, whole: bool = True) -> dict[str, Any]:
    """The message object of a finished output, or (``whole=False``) as ``message_start`` carries it: no content
    or stop reason yet, and nothing generated counted."""
    reason, sequence = stop_reason(output) if whole else (None, None)
    counts = message_usage(output)
    if not whole:
        counts["output_tokens"] = 0
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": output.outputs[0].text}] if whole else [],
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": counts,
    }


def event(payload: dict[str, Any]) -> str:
    """One Server-Sent Event as Anthropic streams them: the event's type as its name, the payload as data."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


def error_body(status_code: int, message: str) -> dict[str, Any]:
    """Anthropic's ``{"type": "error", "error": {"type", "message"}}``."""
    kind = ERROR_TYPES.get(status_code, "api_error" if status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class AnthropicErrorMiddleware:
    """Every error on ``/v1/messages`` in Anthropic's shape, whatever produced it (validation, a handler, the API
    key check, the body cap, the catch-all 500): the OpenAI-shaped JSON the rest of the server writes is rewritten
    here, outermost, so each of those keeps one way to fail."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(MESSAGES_PATH):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewrite(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = b"".join(chunks)
            try:
                payload = json.loads(body)
                body = json.dumps(error_body(start["status"], payload["error"]["message"])).encode()
            except (ValueError, KeyError, TypeError):
                pass  # not an error body of ours (an empty 499): passed on as it is
            headers = MutableHeaders(scope=start)
            headers["content-length"] = str(len(body))
            await send(start)
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewrite)
