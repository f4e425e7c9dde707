"""Anthropic's Messages API: ``POST /v1/messages``, whole or streamed as Anthropic's events, and
``POST /v1/messages/count_tokens``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from prefixcache.engine import RequestOutput
from prefixcache.engine.sampling_params import InvalidParameter
from prefixcache.http.anthropic import (
    CountTokensRequest,
    MessagesRequest,
    error_body,
    event,
    message,
    message_usage,
    stop_reason,
)
from prefixcache.http.middleware import RequestRecord, record_of
from prefixcache.server.async_llm import EngineDeadError, RequestStream
from prefixcache.server.errors import APIError
from prefixcache.server.routes.generation import queue_request
from prefixcache.server.routes.state import Engine, Settings, chat_prompt, model_name
from prefixcache.server.streaming import RequestStreamingResponse, final_outputs, record_outputs

logger = logging.getLogger(__name__)

router = APIRouter()


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request, engine: Engine, settings: Settings) -> Response:
    name = model_name(settings, body.model)
    try:
        params = body.sampling_params()
    except InvalidParameter as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
    messages, marks = body.conversation()
    prompt, retention = await chat_prompt(engine, messages, body.template_tools(), marks)
    record = record_of(request.scope)
    message_id = f"msg_{record.request_id}"
    stream = await queue_request(request, engine, [prompt], params, message_id, None, 1, retention)
    if body.stream:
        return RequestStreamingResponse(stream, _events(stream, message_id, name, record))
    finals = await final_outputs(request, stream)
    if finals is None:
        return Response(status_code=499)
    record_outputs(record, stream, finals, 1)
    output = finals[0]
    if output.outputs[0].error is not None:
        raise APIError(500, output.outputs[0].error, type="server_error")
    return JSONResponse(message(message_id, name, output))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, engine: Engine, settings: Settings) -> dict[str, Any]:
    """The prompt's length as ``/v1/messages`` would run it (Anthropic's endpoint)."""
    model_name(settings, body.model)
    messages, _ = body.conversation()
    prompt, _ = await chat_prompt(engine, messages, body.template_tools())
    return {"input_tokens": len(prompt["prompt_token_ids"])}


async def _events(stream: RequestStream, message_id: str, name: str, record: RequestRecord) -> AsyncIterator[str]:
    """Anthropic's stream: ``message_start`` (with the prompt's usage, once the engine admitted it), one text
    block (start, a ping, deltas, stop), ``message_delta`` with the stop reason and usage, ``message_stop``.
    A failure after the stream started ends it with an ``error`` event."""
    last: RequestOutput | None = None
    failure: str | None = None
    try:
        async for _, output in stream:
            if output.outputs[0].error is not None:
                failure = output.outputs[0].error
                break
            if last is None:
                start = message(message_id, name, output, whole=False)
                yield event({"type": "message_start", "message": start})
                yield event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
                yield event({"type": "ping"})
            last = output
            if output.new_text:
                delta = {"type": "text_delta", "text": output.new_text}
                yield event({"type": "content_block_delta", "index": 0, "delta": delta})
    except EngineDeadError as exc:
        failure = str(exc)
    except Exception:
        logger.exception("request %s failed while streaming", record.request_id)
        failure = f"internal server error (request id {record.request_id})"
    finally:
        record_outputs(record, stream, {} if last is None else {0: last}, 1)
    if failure is not None:
        record.error = failure
        yield event(error_body(500, failure))
        return
    reason, sequence = stop_reason(last)
    yield event({"type": "content_block_stop", "index": 0})
    delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}}
    yield event({**delta, "usage": message_usage(last)})
    yield event({"type": "message_stop"})
