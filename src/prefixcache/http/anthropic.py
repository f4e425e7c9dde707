"""Anthropic's Messages API as prefixcache serves it (``POST /v1/messages``): the request body, the message and
its usage, the streamed events, and Anthropic's error shape.

Text only: content is a string or text blocks, ``system`` a string or text blocks, ``tools`` go to the chat
template (a call the model writes comes back as its text); the conversation runs as the OpenAI chat one it is
(``MessagesConversation``). ``cache_control`` on a tool, a system block or a message's block is a retention
breakpoint (``http/retention.py``). Usage follows Anthropic's accounting:
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
from prefixcache.http.protocol import (
    ChatMessage,
    ChatTool,
    FunctionDefinition,
    Text,
    TextPart,
    conversation_breakpoints,
)
from prefixcache.http.retention import CacheControl, check_breakpoint_count, written_by_ttl

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


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    content: Text | list[TextPart]


class Tool(_Body):
    """A client tool: its definition goes to the chat template as the OpenAI function it is."""

    type: Literal["custom"] | None = None
    name: Text
    description: Text | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None

    def chat_tool(self) -> ChatTool:
        function = FunctionDefinition(name=self.name, description=self.description, parameters=self.input_schema)
        return ChatTool(type="function", function=function, cache_control=self.cache_control)


class Metadata(_Body):
    user_id: Text | None = None


class MessagesConversation(_Body):
    """What a Messages request asks the model to read: its ``messages`` (the last one the user's: a final assistant
    message, Anthropic's prefill, is not implemented), ``system``, ``tools`` and a top-level ``cache_control``,
    which marks the end of the last block of the last message, as Anthropic's automatic caching does.

    It runs as the OpenAI chat conversation it is (``chat_messages``, ``chat_tools``): ``system`` a system message
    first, text blocks content parts, a tool a function, each ``cache_control`` where it was. The server renders
    that; ``explain`` reads a logged Messages body as that chat body (``chat_body``), so its hashes are the ones
    the engine ran."""

    messages: list[InputMessage]
    system: Text | list[TextPart] | None = None
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
    def _bounded_breakpoints(self) -> MessagesConversation:
        check_breakpoint_count(len(self.conversation()[1]))
        return self

    def chat_messages(self) -> list[ChatMessage]:
        """The conversation as OpenAI chat messages: ``system`` first, then the messages; the top-level
        ``cache_control`` as an empty part at the end of the last one (a breakpoint at its end)."""
        messages = [] if self.system is None else [ChatMessage(role="system", content=self.system)]
        messages += [ChatMessage(role=message.role, content=message.content) for message in self.messages]
        if self.cache_control is not None:
            last = messages[-1]
            parts = last.content if isinstance(last.content, list) else [TextPart(type="text", text=last.content)]
            marked = TextPart(type="text", text="", cache_control=self.cache_control)
            messages[-1] = ChatMessage(role=last.role, content=[*parts, marked])
        return messages

    def chat_tools(self) -> list[ChatTool] | None:
        return None if not self.tools else [tool.chat_tool() for tool in self.tools]

    def conversation(self) -> tuple[list[dict[str, str]], list[tuple[Breakpoint, CacheControl]]]:
        """The messages as the chat template takes them and every breakpoint, in the prompt's order (tools,
        system, messages), as the chat endpoint finds them."""
        messages = self.chat_messages()
        return [message.template_dict() for message in messages], conversation_breakpoints(messages, self.chat_tools())

    def template_tools(self) -> list[dict[str, Any]] | None:
        tools = self.chat_tools()
        return None if tools is None else [tool.template_dict() for tool in tools]

    def chat_body(self) -> dict[str, Any]:
        """The chat completions body of the same conversation (what ``explain`` reads a logged Messages body as)."""
        body: dict[str, Any] = {"messages": [message.model_dump(exclude_none=True) for message in self.chat_messages()]}
        tools = self.chat_tools()
        if tools is not None:
            body["tools"] = [tool.model_dump(exclude_none=True) for tool in tools]
        return body


class CountTokensRequest(MessagesConversation):
    """The body of ``POST /v1/messages/count_tokens``: the conversation and the model."""

    model: Text


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
