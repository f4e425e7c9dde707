"""How a generation request's outputs reach its client: Server-Sent Events chunk by chunk, or the final
outputs at once; either way the request is aborted when the client goes away, so its KV blocks are freed."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from prefixcache.engine import RequestOutput
from prefixcache.http.disconnect import unless_disconnected
from prefixcache.http.middleware import RequestRecord
from prefixcache.http.protocol import error_body, usage
from prefixcache.server.async_llm import EngineDeadError, RequestStream
from prefixcache.server.responses import ChoiceShaper

logger = logging.getLogger(__name__)


class RequestStreamingResponse(StreamingResponse):
    """Aborts the request however the response ends: finished, client gone (even before the first chunk)
    or failed. Aborting a finished request does nothing."""

    def __init__(self, stream: RequestStream, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.abort()


_to_json = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps's, without a new encoder per chunk


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {_to_json(payload)}\n\n"


def record_outputs(record: RequestRecord, stream: RequestStream, outputs: dict[int, RequestOutput], n: int) -> None:
    """What the request's log line reports: its token counts, cache hit, first token time and finish reasons."""
    counts = usage(outputs, n)
    record.prompt_tokens = counts["prompt_tokens"]
    record.cached_tokens = counts["prompt_tokens_details"]["cached_tokens"]
    record.generated_tokens = counts["completion_tokens"]
    record.first_token_time = stream.first_token_time
    record.finish_reasons = [str(o.outputs[0].finish_reason) for _, o in sorted(outputs.items()) if o.finished]


async def sse_events(
    stream: RequestStream,
    shaper: ChoiceShaper,
    base: dict[str, Any],
    include_usage: bool,
    n: int,
    record: RequestRecord,
    continuous_usage: bool = False,
    retention: bool = False,
) -> AsyncIterator[str]:
    """One chunk per choice and step, then the usage chunk (if asked) and ``[DONE]``. With
    ``continuous_usage`` every chunk also carries its choice's usage so far (vLLM's
    ``continuous_usage_stats``: the choice's prompt and the tokens it generated up to this chunk). With
    ``retention`` (the request gave directives) the usage reports the retained tokens too.

    A failure after the stream started (the engine died, the server shut down, the request failed in the
    engine, our bug) ends it with an error event, then ``[DONE]``.
    """
    last: dict[int, RequestOutput] = {}
    failure: dict[str, Any] | None = None
    try:
        async for index, output in stream:
            last[index] = output = shaper.visible(output)
            if output.outputs[0].error is not None:
                failure = error_body(output.outputs[0].error, type="server_error")
                break
            chunk = {**base, "choices": [shaper.delta(index, output)]}
            if continuous_usage:
                chunk["usage"] = usage({index: output}, n, retention)
            yield _sse(chunk)
    except EngineDeadError as exc:
        failure = error_body(str(exc), type="server_error")
    except Exception:
        logger.exception("request %s failed while streaming", record.request_id)
        failure = error_body(f"internal server error (request id {record.request_id})", type="server_error")
    finally:
        record_outputs(record, stream, last, n)
    if failure is not None:
        record.error = failure["error"]["message"]
        yield _sse(failure)
    elif include_usage:
        yield _sse({**base, "choices": [], "usage": usage(last, n, retention)})
    yield "data: [DONE]\n\n"


async def final_outputs(request: Request, stream: RequestStream) -> dict[int, RequestOutput] | None:
    """Each choice's finished output of a non-streaming request; None when the client left first. The stream is
    aborted either way, so a request whose client left frees its seat and blocks at once."""

    async def collect() -> dict[int, RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for index, output in stream:
            if output.finished:
                finals[index] = output
        return finals

    try:
        return await unless_disconnected(request, collect())
    finally:
        stream.abort()
