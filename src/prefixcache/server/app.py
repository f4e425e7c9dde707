"""The FastAPI app: OpenAI's completions and chat endpoints, models, health, metrics and cache reset.

Every error, whatever raised it (pydantic, the engine, a bad route, auth), leaves as OpenAI's
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status, and the server keeps serving.
A request whose client goes away is aborted, so its KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from prefixcache.engine import RequestOutput
from prefixcache.engine.input_processor import PromptInput
from prefixcache.server.async_llm import AsyncLLM, EngineDeadError, RequestStream
from prefixcache.server.protocol import ChatCompletionRequest, CompletionRequest, error_body, usage

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for legacy completions
LOG_STATS_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """``served_model_names[0]`` is the name reported by /v1/models; requests may use any of them."""

    served_model_names: tuple[str, ...]
    api_key: str | None = None
    enable_reset_prefix_cache: bool = False
    log_stats_interval: float | None = LOG_STATS_INTERVAL_S


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = error_body(message, type=type, param=param, code=code)


def _error_response(
    status_code: int, message: str, headers: dict[str, str] | None = None, **kwargs: Any
) -> JSONResponse:
    return JSONResponse(error_body(message, **kwargs), status_code=status_code, headers=headers)


class APIKeyMiddleware:
    """Bearer auth on every path except /health, which load balancers probe without credentials.

    Plain ASGI (not ``BaseHTTPMiddleware``), so streaming and disconnect detection pass through untouched,
    and a bad key is refused before the body is even parsed.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self._expected):
                response = _error_response(
                    401,
                    "Incorrect or missing API key; send 'Authorization: Bearer <key>'.",
                    headers={"WWW-Authenticate": "Bearer"},
                    code="invalid_api_key",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _RequestStreamingResponse(StreamingResponse):
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


@dataclass(frozen=True, slots=True)
class _Format:
    """How one endpoint shapes its choices (``text`` for completions, ``message``/``delta`` for chat)."""

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def choice(self, output: RequestOutput) -> dict[str, Any]:
        text = output.outputs[0].text
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": 0, **body, "logprobs": None, **self._finish(output)}

    def delta_choice(self, output: RequestOutput, first: bool) -> dict[str, Any]:
        if self.chat:
            delta = {"role": "assistant", "content": output.new_text} if first else {"content": output.new_text}
            body: dict[str, Any] = {"delta": delta}
        else:
            body = {"text": output.new_text}
        return {"index": 0, **body, "logprobs": None, **self._finish(output)}

    @staticmethod
    def _finish(output: RequestOutput) -> dict[str, Any]:
        completion = output.outputs[0]
        return {"finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}


COMPLETION = _Format("cmpl", "text_completion", "text_completion", chat=False)
CHAT = _Format("chatcmpl", "chat.completion", "chat.completion.chunk", chat=True)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _sse_events(
    stream: RequestStream, fmt: _Format, base: dict[str, Any], include_usage: bool
) -> AsyncIterator[str]:
    """One chunk per generated token, then the usage chunk (if asked) and ``[DONE]``."""
    last: RequestOutput | None = None
    try:
        async for output in stream:
            yield _sse({**base, "choices": [fmt.delta_choice(output, first=last is None)]})
            last = output
    except EngineDeadError as exc:
        yield _sse(error_body(str(exc), type="server_error"))
    else:
        if include_usage and last is not None:
            yield _sse({**base, "choices": [], "usage": usage(last)})
    yield "data: [DONE]\n\n"


async def _final_output(stream: RequestStream) -> RequestOutput:
    async for output in stream:
        if output.finished:
            return output
    raise AssertionError("a stream ends with its finished output")


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``, but cancel it and return None if the client disconnects first.

    A non-streaming handler is otherwise never told that its client left, and would keep generating.
    """

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return _error_response(400, f"malformed JSON body: {detail}", code="invalid_json")
    locations = [".".join(str(p) for p in e["loc"][1:] if p != "body") or "body" for e in errors]
    message = "; ".join(
        f"{loc}: {e['msg'].removeprefix('Value error, ')}" for loc, e in zip(locations, errors, strict=True)
    )
    return _error_response(400, message, param=locations[0].split(".")[0])


def build_app(engine: AsyncLLM, settings: ServerSettings) -> FastAPI:
    """The app around a not-yet-started engine; the app's lifespan starts its core process and stops it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        log_task = None
        if settings.log_stats_interval:
            log_task = asyncio.create_task(_log_stats_every(engine, settings.log_stats_interval))
        try:
            yield
        finally:
            if log_task is not None:
                log_task.cancel()
            await engine.shutdown()

    app = FastAPI(title="prefixcache", lifespan=lifespan)
    started = int(time.time())
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(EngineDeadError)
    async def _engine_error(request: Request, exc: EngineDeadError) -> JSONResponse:
        return _error_response(503, str(exc), type="server_error", code="engine_unavailable")

    def model_name(requested: str | None) -> str:
        if requested is None:
            return settings.served_model_names[0]
        if requested not in settings.served_model_names:
            raise APIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")
        return requested

    async def generate(
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        name: str,
        prompt: PromptInput,
        max_tokens: int,
        fmt: _Format,
    ) -> Response:
        """Queue the request and answer it, streamed or whole; bad sampling values or prompts are 400s."""
        request_id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
        try:
            params = body.sampling_params(max_tokens)
            stream = await engine.add_request(prompt, params, request_id, body.cache_salt)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        base = {"id": request_id, "object": fmt.chunk_object, "created": int(time.time()), "model": name}
        if body.stream:
            return _RequestStreamingResponse(stream, _sse_events(stream, fmt, base, body.include_usage))
        try:
            output = await _unless_disconnected(request, _final_output(stream))
        finally:
            stream.abort()
        if output is None:
            return Response(status_code=499)
        return JSONResponse({**base, "object": fmt.object, "choices": [fmt.choice(output)], "usage": usage(output)})

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        return await generate(request, body, model_name(body.model), body.prompt, max_tokens, COMPLETION)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        name = model_name(body.model)  # an unknown model is a 404 before any template work
        try:
            prompt_ids = await engine.apply_chat_template([m.template_dict() for m in body.messages])
        except (ValueError, TemplateError) as exc:
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        # Unset: generate up to the context; at least 1, so an overlong prompt gets the context error.
        max_tokens = requested if requested is not None else max(1, engine.info.max_model_len - len(prompt_ids))
        prompt = {"prompt": None, "prompt_token_ids": prompt_ids}
        return await generate(request, body, name, prompt, max_tokens, CHAT)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": started,
                    "owned_by": "prefixcache",
                    "root": name,
                    "max_model_len": engine.info.max_model_len,
                    "vocab_size": engine.info.vocab_size,
                }
                for name in settings.served_model_names
            ],
        }

    @app.get("/v1/cache/config")
    async def cache_config() -> dict[str, Any]:
        """How this server keys its prefix cache and where it publishes KV events: what a router needs."""
        info = engine.info
        events = getattr(engine.config, "kv_events_config", None)  # None until KV events are merged
        publishing = events is not None and events.enable_kv_cache_events and events.publisher == "zmq"
        return {
            "model": settings.served_model_names[0],
            "max_model_len": info.max_model_len,
            "block_size": info.block_size,
            "hash_algo": info.hash_algo,
            "hash_seed": info.hash_seed,
            "enable_prefix_caching": info.enable_prefix_caching,
            "kv_events": (
                {"endpoint": events.endpoint, "replay_endpoint": events.replay_endpoint, "topic": events.topic}
                if publishing
                else None
            ),
        }

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.accepting else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if settings.enable_reset_prefix_cache:

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> dict[str, bool]:
            """Drops every tenant's cached prefixes; refused (success false) while any block is in use."""
            return {"success": await engine.reset_prefix_cache()}

    return app


async def _log_stats_every(engine: AsyncLLM, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        if engine.latest_stats is not None:
            engine.metrics.log_stats(engine.latest_stats, time.monotonic())
