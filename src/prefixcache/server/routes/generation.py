"""OpenAI's completions and chat completions: validate, queue on the engine, answer streamed or whole."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from prefixcache.core.retention import RetentionRange
from prefixcache.core.tenant_salt import engine_salt
from prefixcache.engine.input_processor import DEFAULT_PROMPT_OPTIONS, PromptOptions
from prefixcache.engine.sampling_params import InvalidParameter, SamplingParams
from prefixcache.http.middleware import record_of, tenant_of
from prefixcache.http.protocol import ChatCompletionRequest, CompletionRequest, usage
from prefixcache.http.retention import range_json, request_ranges
from prefixcache.server.async_llm import AsyncLLM, RequestStream
from prefixcache.server.errors import APIError
from prefixcache.server.responses import CHAT, COMPLETION, ChoiceShaper, Endpoint
from prefixcache.server.routes.state import Engine, Settings, chat_prompt, model_name
from prefixcache.server.streaming import (
    RequestStreamingResponse,
    final_outputs,
    record_outputs,
    sse_events,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for legacy completions

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, engine: Engine, settings: Settings) -> Response:
    name = model_name(settings, body.model)
    max_tokens, prompt_logprobs = _completion_limits(body)
    shaper = _shaper(engine, body, COMPLETION, body.logprobs, body.echo, body.prompt_only)
    retention = request_ranges(body.retention, body.prompt_cache_retention)
    options = _completion_options(body)
    return await _generate(
        request, engine, body, name, body.prompts, max_tokens, shaper, retention, prompt_logprobs, options
    )


@router.post("/v1/chat/completions")
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, engine: Engine, settings: Settings
) -> Response:
    name = model_name(settings, body.model)  # an unknown model is a 404 before any template work
    prompt, max_tokens, breakpoints = await _chat_prompt(engine, body)
    shaper = _shaper(engine, body, CHAT, body.num_logprobs)
    retention = breakpoints + request_ranges(body.retention, body.prompt_cache_retention)
    return await _generate(request, engine, body, name, [prompt], max_tokens, shaper, retention)


@router.post("/v1/completions/render")
async def render_completion(
    body: CompletionRequest, request: Request, engine: Engine, settings: Settings
) -> list[dict[str, Any]]:
    """vLLM's: the token ids each prompt of this completion request would run on, one entry per prompt, with
    the sampling parameters it would get; runs no model (vllm-router calls it before routing)."""
    name = model_name(settings, body.model)
    max_tokens, prompt_logprobs = _completion_limits(body)
    retention = request_ranges(body.retention, body.prompt_cache_retention)
    options = _completion_options(body)
    return await _render(
        request, engine, body, name, body.prompts, max_tokens, COMPLETION, retention, prompt_logprobs, options
    )


@router.post("/v1/chat/completions/render")
async def render_chat_completion(
    body: ChatCompletionRequest, request: Request, engine: Engine, settings: Settings
) -> dict[str, Any]:
    """vLLM's: the token ids this chat request would run on (its messages through the chat template), and the
    retention ranges it would ask for (where its ``cache_control`` breakpoints landed)."""
    name = model_name(settings, body.model)
    prompt, max_tokens, breakpoints = await _chat_prompt(engine, body)
    retention = breakpoints + request_ranges(body.retention, body.prompt_cache_retention)
    [rendered] = await _render(request, engine, body, name, [prompt], max_tokens, CHAT, retention)
    return rendered


def _completion_limits(body: CompletionRequest) -> tuple[int, int | None]:
    """The engine's max_tokens and prompt_logprobs for a completion request."""
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    if body.prompt_only:
        max_tokens = 1  # the engine ends a request on a sampled token; the answer leaves it out
    # echo with logprobs also returns the prompt's (which computes the whole prompt: no cache read)
    return max_tokens, body.logprobs if body.echo else None


def _completion_options(body: CompletionRequest) -> PromptOptions:
    return PromptOptions(add_special_tokens=body.add_special_tokens, prompt_only=body.prompt_only)


async def _chat_prompt(
    engine: AsyncLLM, body: ChatCompletionRequest
) -> tuple[dict[str, Any], int, list[RetentionRange]]:
    """The conversation as a prompt of token ids, the engine's max_tokens for it and its breakpoints' ranges."""
    prompt, breakpoints = await chat_prompt(
        engine, body.template_messages(), body.template_tools(), body.breakpoints(), body.add_special_tokens
    )
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    # Unset: generate as far as the request may grow (the context, or less where the KV cache holds less); at
    # least 1, so an overlong prompt gets the context error (or, with truncate_prompt_tokens -1, keeps all but
    # one token of what fits).
    prompt_len = len(prompt["prompt_token_ids"])
    if body.truncate_prompt_tokens is not None and body.truncate_prompt_tokens > 0:
        prompt_len = min(prompt_len, body.truncate_prompt_tokens)
    max_tokens = requested if requested is not None else max(1, engine.info.max_request_tokens - prompt_len)
    return prompt, max_tokens, breakpoints


def _sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    num_logprobs: int | None,
    prompt_logprobs: int | None,
) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens, num_logprobs, prompt_logprobs)
    except InvalidParameter as exc:
        raise APIError(400, str(exc), param=exc.param) from exc


async def _render(
    request: Request,
    engine: AsyncLLM,
    body: CompletionRequest | ChatCompletionRequest,
    name: str,
    prompts: list[Any],
    max_tokens: int,
    endpoint: Endpoint,
    retention: list[RetentionRange],
    prompt_logprobs: int | None = None,
    options: PromptOptions = DEFAULT_PROMPT_OPTIONS,
) -> list[dict[str, Any]]:
    num_logprobs = body.logprobs if isinstance(body, CompletionRequest) else body.num_logprobs
    params = _sampling_params(body, max_tokens, num_logprobs, prompt_logprobs)
    try:
        rendered = await engine.render(prompts, params, tuple(retention), options)
    except ValueError as exc:
        raise _refused(exc) from exc
    request_id = f"{endpoint.id_prefix}-{record_of(request.scope).request_id}"
    return [
        {
            "request_id": request_id if len(rendered) == 1 else f"{request_id}-{index}",
            "token_ids": token_ids,
            "sampling_params": asdict(params),
            "model": name,
            "stream": body.stream,
            "cache_salt": body.cache_salt,
            "retention": [range_json(directive) for directive in retention],
        }
        for index, token_ids in enumerate(rendered)
    ]


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def _shaper(
    engine: AsyncLLM,
    body: CompletionRequest | ChatCompletionRequest,
    endpoint: Endpoint,
    num_logprobs: int | None,
    echo: bool = False,
    prompt_only: bool = False,
) -> ChoiceShaper:
    token_text = _token_id_text if body.return_tokens_as_token_ids else engine.token_text
    return ChoiceShaper(endpoint, token_text, num_logprobs, echo, engine.tokenizer.decode, prompt_only)


async def _generate(
    request: Request,
    engine: AsyncLLM,
    body: CompletionRequest | ChatCompletionRequest,
    name: str,
    prompts: list[Any],
    max_tokens: int,
    shaper: ChoiceShaper,
    retention: list[RetentionRange],
    prompt_logprobs: int | None = None,
    options: PromptOptions = DEFAULT_PROMPT_OPTIONS,
) -> Response:
    """Queue the request and answer it, streamed or whole; bad sampling values, prompts or retention ranges
    (one past a prompt) are 400s."""
    record = record_of(request.scope)
    endpoint = shaper.endpoint
    response_id = f"{endpoint.id_prefix}-{record.request_id}"
    params = _sampling_params(body, max_tokens, shaper.num_logprobs, prompt_logprobs)
    stream = await queue_request(
        request, engine, prompts, params, response_id, body.cache_salt, body.n, retention, options
    )
    base = {"id": response_id, "object": endpoint.chunk_object, "created": int(time.time()), "model": name}
    if body.stream:
        events = sse_events(
            stream, shaper, base, body.include_usage, body.n, record, body.continuous_usage, body.has_directives
        )
        return RequestStreamingResponse(stream, events)
    finals = await final_outputs(request, stream)
    if finals is None:
        return Response(status_code=499)
    finals = {index: shaper.visible(output) for index, output in finals.items()}
    record_outputs(record, stream, finals, body.n)
    errors = [o.outputs[0].error for o in finals.values() if o.outputs[0].error is not None]
    if errors:
        raise APIError(500, errors[0], type="server_error")
    choices = [shaper.choice(index, output) for index, output in sorted(finals.items())]
    counts = usage(finals, body.n, body.has_directives)
    return JSONResponse({**base, "object": endpoint.object, "choices": choices, "usage": counts})


async def queue_request(
    request: Request,
    engine: AsyncLLM,
    prompts: list[Any],
    params: SamplingParams,
    response_id: str,
    cache_salt: str | None,
    n: int,
    retention: list[RetentionRange],
    options: PromptOptions = DEFAULT_PROMPT_OPTIONS,
) -> RequestStream:
    """Queue the request for its tenant (salted by its API key, which also bounds its retention); a prompt or a
    retention range the engine refuses is a 400 (naming ``retention`` for a range past the prompt)."""
    tenant = tenant_of(request.scope)
    try:
        return await engine.add_request(
            prompts, params, response_id, engine_salt(tenant, cache_salt), n, tuple(retention), tenant, options
        )
    except ValueError as exc:
        raise _refused(exc) from exc


def _refused(exc: ValueError) -> APIError:
    """The 400 for a request the input processor refused; its retention errors name the field."""
    message = str(exc)
    return APIError(400, message, param="retention" if message.startswith("retention") else None)
