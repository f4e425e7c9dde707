"""The router's endpoints: OpenAI's completions and chat and Anthropic's Messages API, proxied to the backend
each is routed to; the models and Anthropic's token count, answered by the first backend in the rotation; the
router's own health and Prometheus metrics.

Each handler reads the router's parts from ``app.state`` (``build_app`` puts them there), so the app module
only assembles them.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from prefixcache.http.anthropic import MESSAGES_PATH
from prefixcache.router.prompt import CHAT, COMPLETION, MESSAGES

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await request.app.state.proxy.forward("/v1/completions", request, COMPLETION)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await request.app.state.proxy.forward("/v1/chat/completions", request, CHAT)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    return await request.app.state.proxy.unrouted("/v1/models", request)


@router.post(MESSAGES_PATH)
async def messages(request: Request) -> Response:
    return await request.app.state.proxy.forward(MESSAGES_PATH, request, MESSAGES)


@router.post(f"{MESSAGES_PATH}/count_tokens")
async def count_tokens(request: Request) -> Response:
    return await request.app.state.proxy.unrouted(f"{MESSAGES_PATH}/count_tokens", request)


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while at least one backend is in the rotation."""
    return Response(status_code=200 if request.app.state.pool.routable() else 503)


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    state = request.app.state
    index, metrics = state.index, state.metrics
    metrics.index_blocks.set(len(index))
    for backend in state.pool.backends:
        metrics.backend_blocks.labels(backend.url).set(index.num_blocks(backend.url))
        metrics.backend_up.labels(backend.url).set(int(backend.routable))
        metrics.tokens_in_flight.labels(backend.url).set(backend.tokens_in_flight)
        metrics.requests_in_flight.labels(backend.url).set(backend.requests_in_flight)
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
