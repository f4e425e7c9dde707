"""The FastAPI app: OpenAI's completions and chat endpoints, vLLM's tokenize/detokenize, models, version,
health, metrics, cache lookup and reset.

Every error, whatever raised it (pydantic, the engine, a bad route, auth, the body cap), leaves as OpenAI's
``{"error": {"message", "type", "param", "code"}}``: a 4xx for bad input, a 500 only for our own bugs
(logged with the traceback), and the server keeps serving. A request whose client goes away is aborted,
so its KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from importlib.metadata import version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from prefixcache.engine import RequestOutput
from prefixcache.engine.input_processor import PromptInput
from prefixcache.engine.sampling_params import InvalidParameter
from prefixcache.server.async_llm import AsyncLLM, EngineDeadError, RequestStream
from prefixcache.server.cli import DEFAULT_MAX_REQUEST_BYTES
from prefixcache.server.disconnect import unless_disconnected
from prefixcache.server.middleware import (
    APIKeyMiddleware,
    BodyLimitMiddleware,
    RequestContextMiddleware,
    RequestRecord,
    record_of,
    tenant_of,
)
from prefixcache.server.protocol import (
    ChatCompletionRequest,
    ChatLookupRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    error_response,
    lookup_request,
    usage,
)
from prefixcache.server.responses import CHAT, COMPLETION, ChoiceShaper, Endpoint
from prefixcache.server.tenants import SALT_BY_API_KEY, engine_salt, valid_api_key

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for legacy completions
LOG_STATS_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """``served_model_names[0]`` is the name reported by /v1/models; requests may use any of them.

    Each of ``api_keys`` is a tenant with its own prefix cache unless ``share_cache_across_keys``.
    """

    served_model_names: tuple[str, ...]
    api_keys: tuple[str, ...] = ()
    share_cache_across_keys: bool = False
    enable_reset_prefix_cache: bool = False
    log_stats_interval: float | None = LOG_STATS_INTERVAL_S
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    log_requests: bool = True

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("at least one served model name is needed")
        if not all(map(valid_api_key, self.api_keys)):
            raise ValueError("API keys must be non-empty printable ASCII without spaces")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {self.max_request_bytes}")


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


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _record_outputs(record: RequestRecord, stream: RequestStream, outputs: dict[int, RequestOutput], n: int) -> None:
    counts = usage(outputs, n)
    record.prompt_tokens = counts["prompt_tokens"]
    record.cached_tokens = counts["prompt_tokens_details"]["cached_tokens"]
    record.generated_tokens = counts["completion_tokens"]
    record.first_token_time = stream.first_token_time
    record.finish_reasons = [str(o.outputs[0].finish_reason) for _, o in sorted(outputs.items()) if o.finished]


async def _sse_events(
    stream: RequestStream,
    shaper: ChoiceShaper,
    base: dict[str, Any],
    include_usage: bool,
    n: int,
    record: RequestRecord,
) -> AsyncIterator[str]:
    """One chunk per choice and step, then the usage chunk (if asked) and ``[DONE]``.

    A failure after the stream started (the engine died, the server shut down, the request failed in the
    engine, our bug) ends it with an error event, then ``[DONE]``.
    """
    last: dict[int, RequestOutput] = {}
    failure: dict[str, Any] | None = None
    try:
        async for index, output in stream:
            last[index] = output
            if output.outputs[0].error is not None:
                failure = error_body(output.outputs[0].error, type="server_error")
                break
            yield _sse({**base, "choices": [shaper.delta(index, output)]})
    except EngineDeadError as exc:
        failure = error_body(str(exc), type="server_error")
    except Exception:
        logger.exception("request %s failed while streaming", record.request_id)
        failure = error_body(f"internal server error (request id {record.request_id})", type="server_error")
    finally:
        _record_outputs(record, stream, last, n)
    if failure is not None:
        record.error = failure["error"]["message"]
        yield _sse(failure)
    elif include_usage:
        yield _sse({**base, "choices": [], "usage": usage(last, n)})
    yield "data: [DONE]\n\n"


async def _final_outputs(stream: RequestStream) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for index, output in stream:
        if output.finished:
            finals[index] = output
    return finals


_UNION_MEMBER_NAMES = frozenset({"str", "int", "float", "bool"})


def _location(loc: tuple[Any, ...]) -> str:
    """A field's path as a client wrote it: ``messages.0.content``, without pydantic's union member names."""
    parts = [str(p) for p in loc[1:] if isinstance(p, int) or (p.isidentifier() and p not in _UNION_MEMBER_NAMES)]
    return ".".join(parts) or "body"


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return error_response(400, f"malformed JSON body: {detail}", code="invalid_json")
    # Our own checks say most; a union's other members only say "not a list", "not a string".
    errors = [e for e in errors if e["type"] in ("value_error", "extra_forbidden")] or errors
    messages: dict[str, str] = {}
    for error in errors:
        location = _location(error["loc"])
        if error["type"] == "extra_forbidden":
            message = "unsupported parameter: this server does not implement it"
        else:
            message = error["msg"].removeprefix("Value error, ")
        messages.setdefault(location, message)
    text = "; ".join(f"{location}: {message}" for location, message in messages.items())
    param = next(iter(messages)).split(".")[0]
    return error_response(400, text, param=None if param == "body" else param)


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
    # Added innermost first: the request context wraps everything, auth runs before the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=settings.api_keys, share_cache=settings.share_cache_across_keys)
    app.add_middleware(RequestContextMiddleware, log_requests=settings.log_requests)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status_code, **exc.body["error"])

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(EngineDeadError)
    async def _engine_error(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), type="server_error", code="engine_unavailable")

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
        prompts: list[Any],
        max_tokens: int,
        shaper: ChoiceShaper,
        prompt_logprobs: int | None = None,
    ) -> Response:
        """Queue the request and answer it, streamed or whole; bad sampling values or prompts are 400s."""
        record = record_of(request.scope)
        endpoint = shaper.endpoint
        response_id = f"{endpoint.id_prefix}-{record.request_id}"
        try:
            params = body.sampling_params(max_tokens, shaper.num_logprobs, prompt_logprobs)
            salt = engine_salt(tenant_of(request.scope), body.cache_salt)
            stream = await engine.add_request(prompts, params, response_id, salt, body.n)
        except InvalidParameter as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        base = {"id": response_id, "object": endpoint.chunk_object, "created": int(time.time()), "model": name}
        if body.stream:
            events = _sse_events(stream, shaper, base, body.include_usage, body.n, record)
            return _RequestStreamingResponse(stream, events)
        try:
            finals = await unless_disconnected(request, _final_outputs(stream))
        finally:
            stream.abort()
        if finals is None:
            return Response(status_code=499)
        _record_outputs(record, stream, finals, body.n)
        errors = [o.outputs[0].error for o in finals.values() if o.outputs[0].error is not None]
        if errors:
            raise APIError(500, errors[0], type="server_error")
        choices = [shaper.choice(index, output) for index, output in sorted(finals.items())]
        return JSONResponse({**base, "object": endpoint.object, "choices": choices, "usage": usage(finals, body.n)})

    def shaper_for(
        body: CompletionRequest | ChatCompletionRequest,
        endpoint: Endpoint,
        num_logprobs: int | None,
        echo: bool = False,
    ) -> ChoiceShaper:
        token_text = _token_id_text if body.return_tokens_as_token_ids else engine.token_text
        return ChoiceShaper(endpoint, token_text, num_logprobs, echo, engine.tokenizer.decode)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        # echo with logprobs also returns the prompt's (which computes the whole prompt: no cache read)
        prompt_logprobs = body.logprobs if body.echo else None
        shaper = shaper_for(body, COMPLETION, body.logprobs, body.echo)
        return await generate(request, body, model_name(body.model), body.prompts, max_tokens, shaper, prompt_logprobs)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        name = model_name(body.model)  # an unknown model is a 404 before any template work
        prompt_ids = await apply_chat_template(body.messages)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        # Unset: generate up to the context; at least 1, so an overlong prompt gets the context error.
        max_tokens = requested if requested is not None else max(1, engine.info.max_model_len - len(prompt_ids))
        prompt = {"prompt": None, "prompt_token_ids": prompt_ids}
        return await generate(request, body, name, [prompt], max_tokens, shaper_for(body, CHAT, body.num_logprobs))

    async def apply_chat_template(messages: list[Any], add_generation_prompt: bool = True) -> list[int]:
        try:
            return await engine.apply_chat_template([m.template_dict() for m in messages], add_generation_prompt)
        except (ValueError, TemplateError) as exc:
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's shape; a prompt is tokenized as the completions endpoint does (no special tokens added)."""
        model_name(body.model)
        if body.messages is not None:
            tokens = await apply_chat_template(body.messages, body.add_generation_prompt)
        else:
            tokens = await engine.tokenize(body.prompt, body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": engine.info.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        model_name(body.model)
        vocab_size = engine.info.vocab_size
        if any(not 0 <= t < vocab_size for t in body.tokens):
            raise APIError(400, f"tokens must be in [0, {vocab_size})", param="tokens")
        return {"prompt": await engine.detokenize(body.tokens)}

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": version("prefixcache")}

    @app.post("/v1/cache/lookup")
    async def cache_lookup(request: Request, raw: dict[str, Any]) -> dict[str, Any]:
        """How much of a prompt the prefix cache and its offload tiers hold now for this tenant, the body being
        the one the completions or the chat endpoint takes; runs no model and changes nothing."""
        try:
            body = lookup_request(raw)
        except ValidationError as exc:  # reported like any other body the endpoints refuse
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        model_name(body.model)
        if isinstance(body, ChatLookupRequest):
            prompt: PromptInput = await apply_chat_template(body.messages)
        else:
            prompt = body.prompts[0]
        try:
            token_ids, found = await engine.lookup(prompt, engine_salt(tenant_of(request.scope), body.cache_salt))
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        answer = asdict(found)
        if body.return_token_ids:
            answer["prompt_token_ids"] = token_ids
            answer["prompt_token_texts"] = await engine.token_texts(token_ids)
        return answer

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
        """How this server keys its prefix cache and where it publishes KV events: what a router needs.

        ``tenant_salt`` is ``"api_key"`` when each API key is a tenant (the engine's salt is ``engine_salt`` of
        the key's ``tenant_salt`` and the body's ``cache_salt``), null when only ``cache_salt`` salts.
        ``kv_events.endpoint_bound`` false: the publisher connects to ``endpoint``, where a subscriber must bind."""
        info = engine.info
        keyed = bool(settings.api_keys) and not settings.share_cache_across_keys
        events = engine.config.kv_events_config
        publishing = events is not None and events.enable_kv_cache_events and events.publisher == "zmq"
        return {
            "model": settings.served_model_names[0],
            "max_model_len": info.max_model_len,
            "block_size": info.block_size,
            "hash_algo": info.hash_algo,
            "hash_seed": info.hash_seed,
            "enable_prefix_caching": info.enable_prefix_caching,
            "tenant_salt": SALT_BY_API_KEY if keyed else None,
            "kv_events": (
                {
                    "endpoint": events.endpoint,
                    "endpoint_bound": events.binds_endpoint,
                    "replay_endpoint": events.replay_endpoint,
                    "topic": events.topic,
                }
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
