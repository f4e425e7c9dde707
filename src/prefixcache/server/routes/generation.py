"""OpenAI's completions and chat completions: validate, queue on the engine, answer streamed or whole."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from prefixcache.engine.sampling_params import InvalidParameter
from prefixcache.server.async_llm import AsyncLLM
from prefixcache.server.errors import APIError
from prefixcache.server.middleware import record_of, tenant_of
from prefixcache.server.protocol import ChatCompletionRequest, CompletionRequest, usage
from prefixcache.server.responses import CHAT, COMPLETION, ChoiceShaper, Endpoint
from prefixcache.server.routes.state import Engine, Settings, apply_chat_template, model_name
from prefixcache.server.streaming import (
    RequestStreamingResponse,
    final_outputs,
    record_outputs,
    sse_events,
    unless_disconnected,
)
from prefixcache.server.tenants import engine_salt

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for legacy completions

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, engine: Engine, settings: Settings) -> Response:
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    # echo with logprobs also returns the prompt's (which computes the whole prompt: no cache read)
    prompt_logprobs = body.logprobs if body.echo else None
    shaper = _shaper(engine, body, COMPLETION, body.logprobs, body.echo)
    name = model_name(settings, body.model)
    return await _generate(request, engine, body, name, body.prompts, max_tokens, shaper, prompt_logprobs)


@router.post("/v1/chat/completions")
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, engine: Engine, settings: Settings
) -> Response:
    name = model_name(settings, body.model)  # an unknown model is a 404 before any template work
    prompt_ids = await apply_chat_template(engine, body.messages)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    # Unset: generate up to the context; at least 1, so an overlong prompt gets the context error.
    max_tokens = requested if requested is not None else max(1, engine.info.max_model_len - len(prompt_ids))
    prompt = {"prompt": None, "prompt_token_ids": prompt_ids}
    shaper = _shaper(engine, body, CHAT, body.num_logprobs)
    return await _generate(request, engine, body, name, [prompt], max_tokens, shaper)


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def _shaper(
    engine: AsyncLLM,
    body: CompletionRequest | ChatCompletionRequest,
    endpoint: Endpoint,
    num_logprobs: int | None,
    echo: bool = False,
) -> ChoiceShaper:
    token_text = _token_id_text if body.return_tokens_as_token_ids else engine.token_text
    return ChoiceShaper(endpoint, token_text, num_logprobs, echo, engine.tokenizer.decode)


async def _generate(
    request: Request,
    engine: AsyncLLM,
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
        events = sse_events(stream, shaper, base, body.include_usage, body.n, record)
        return RequestStreamingResponse(stream, events)
    try:
        finals = await unless_disconnected(request, final_outputs(stream))
    finally:
        stream.abort()
    if finals is None:
        return Response(status_code=499)
    record_outputs(record, stream, finals, body.n)
    errors = [o.outputs[0].error for o in finals.values() if o.outputs[0].error is not None]
    if errors:
        raise APIError(500, errors[0], type="server_error")
    choices = [shaper.choice(index, output) for index, output in sorted(finals.items())]
    return JSONResponse({**base, "object": endpoint.object, "choices": choices, "usage": usage(finals, body.n)})
