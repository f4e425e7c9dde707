"""Forwarding one request to the chosen backend, and once more elsewhere if it fails before any byte.

The body goes to the backend as received and the response comes back as sent: an SSE stream chunk by
chunk, unchanged (``X-Prefixcache-Backend`` names the backend in the headers; the backend gets the router's
``X-Request-Id``, so one id names the request in both logs). A request is retried once on another backend
when the backend cannot be reached, drops the connection before the first byte, or answers 5xx; after the
first byte reached the client nothing can be retried. A backend that breaks off later ends an SSE stream
with an error event in the API's shape (OpenAI's and ``[DONE]``; Anthropic's ``error`` event on
``/v1/messages``), as the server does when its engine dies, or, in the middle of an event or of a JSON body,
drops the client's connection: the client sees the failure either way. A client that leaves before its
response starts has its backend request cancelled. Whatever the backend reports in ``usage`` is compared with
the router's prediction: OpenAI's ``cached_tokens`` with the predicted hit, Anthropic's
``cache_read_input_tokens`` (tokens read from retained blocks) with the predicted retained run of the hit.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefixcache.http import anthropic
from prefixcache.http.auth import authorization
from prefixcache.http.disconnect import unless_disconnected
from prefixcache.http.middleware import REQUEST_ID_HEADER, record_of
from prefixcache.http.protocol import error_body, error_response
from prefixcache.router.backends import Backend, BackendPool
from prefixcache.router.metrics import RouterMetrics
from prefixcache.router.policy import Candidate
from prefixcache.router.prompt import MESSAGES, PromptShape
from prefixcache.router.routing import Lease, Router

logger = logging.getLogger(__name__)

BACKEND_HEADER = "x-prefixcache-backend"
ATTEMPTS = 2
_HOP_BY_HOP = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade"})
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")
_OPENAI_STREAM_END = b"data: [DONE]"
_MESSAGES_STREAM_END = b"event: message_stop"


def forwarded_headers(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}


class BackendBrokeOff(Exception):
    """Raised into the client's response when the backend failed after bytes reached the client, where no
    error can be appended that the client would parse: the server then drops the client's connection."""


class UsageScanner:
    """Finds the top-level ``usage`` object in an SSE stream as its bytes pass by (a line may span chunks), and
    tells whether the stream so far ends between events and whether its last line (``end``: ``[DONE]``, or
    Anthropic's ``message_stop`` event) went by."""

    def __init__(self, end: bytes = _OPENAI_STREAM_END) -> None:
        self.usage: dict[str, Any] | None = None
        self.done = False
        self._end = end
        self._partial = b""
        self._tail = b""

    @property
    def between_events(self) -> bool:
        return not self._tail or self._tail.endswith(_EVENT_ENDS)

    def feed(self, chunk: bytes) -> None:
        self._tail = (self._tail + chunk)[-4:]
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if line.rstrip(b"\r") == self._end:
                self.done = True
            elif line.startswith(b"data:") and b'"usage"' in line:
                try:
                    usage = json.loads(line[5:]).get("usage")
                except (ValueError, AttributeError, RecursionError):
                    continue
                if isinstance(usage, dict):
                    self.usage = usage


class Proxy:
    def __init__(self, router: Router, pool: BackendPool, client: httpx.AsyncClient, metrics: RouterMetrics) -> None:
        self.router = router
        self.pool = pool
        self.client = client
        self.metrics = metrics

    async def forward(self, path: str, request: Request, shape: PromptShape) -> Response:
        """Route and forward a POST whose prompt comes in ``shape``; 400 for a prompt too long for the context,
        503 when no backend can take it, 502 when both attempts failed; 499 (to nobody) when the client left
        before its response started."""
        raw_body = await request.body()
        response = await unless_disconnected(request, self._route(path, raw_body, _backend_headers(request), shape))
        return Response(status_code=499) if response is None else response

    async def _route(self, path: str, raw_body: bytes, request_headers: dict[str, str], shape: PromptShape) -> Response:
        try:
            parsed = json.loads(raw_body)
        except (ValueError, RecursionError):  # the backend will answer the error in its own words
            parsed = None
        body = parsed if isinstance(parsed, dict) else None
        plan = await self.router.plan(body, shape, authorization(request_headers) or None)
        if plan.refusal is not None:
            return error_response(400, plan.refusal)
        tried: list[str] = []
        failure = ""
        for attempt in range(ATTEMPTS):
            picked = self.router.choose(plan, tried)
            if picked is None:
                break
            backend, chosen = picked
            tried.append(backend.url)
            self.metrics.requests.labels(backend.url).inc()
            lease = self.router.admit(backend, plan, chosen)
            response, failure = await self._attempt(
                backend, chosen, lease, path, raw_body, request_headers, attempt, shape
            )
            if response is not None:
                return response
            self.metrics.retries.labels(backend.url).inc()
        if failure:
            return JSONResponse(error_body(f"backends failed: {failure}", type="server_error"), status_code=502)
        self.metrics.unrouted.inc()
        return JSONResponse(error_body("no backend is available", type="server_error"), status_code=503)

    async def unrouted(self, path: str, request: Request) -> Response:
        """A request that uses no cache (``GET /v1/models``, ``POST /v1/messages/count_tokens``) answered by the
        first backend in the rotation."""
        body = await request.body()
        for backend in self.pool.routable():
            try:
                upstream = await self.client.request(
                    request.method, f"{backend.url}{path}", content=body, headers=_backend_headers(request)
                )
            except httpx.TransportError as exc:
                await self.pool.take_down(backend, f"{type(exc).__name__}: {exc}")
                continue
            return Response(upstream.content, upstream.status_code, headers=self._response_headers(upstream, backend))
        return JSONResponse(error_body("no backend is available", type="server_error"), status_code=503)

    async def _attempt(
        self,
        backend: Backend,
        chosen: Candidate,
        lease: Lease,
        path: str,
        raw_body: bytes,
        headers: dict[str, str],
        attempt: int,
        shape: PromptShape,
    ) -> tuple[Response | None, str]:
        """The response to return, or (None, why) when this attempt failed and may be retried."""
        request = self.client.build_request("POST", f"{backend.url}{path}", content=raw_body, headers=headers)
        upstream: httpx.Response | None = None
        relayed = False
        try:
            upstream = await self.client.send(request, stream=True)
            if upstream.status_code >= 500 and attempt + 1 < ATTEMPTS:
                await upstream.aread()
                raise _Retry(f"{backend.url} answered {upstream.status_code}")
            chunks = upstream.aiter_raw()
            first = await anext(chunks, None)
            relayed = True
        except (httpx.TransportError, _Retry) as exc:
            why = str(exc) if isinstance(exc, _Retry) else f"{backend.url}: {type(exc).__name__}: {exc}"
            if isinstance(exc, httpx.TransportError):
                await self.pool.take_down(backend, why)
            logger.warning("attempt %d failed before any byte was sent: %s", attempt + 1, why)
            return None, why
        finally:  # also when the client left and this attempt is cancelled: the backend request is closed
            if not relayed:
                lease.release()
                if upstream is not None:
                    await upstream.aclose()
        body = self._relay(first, chunks, upstream, lease, backend, chosen, shape)
        return StreamingResponse(body, upstream.status_code, headers=self._response_headers(upstream, backend)), ""

    async def _relay(
        self,
        first: bytes | None,
        chunks: AsyncIterator[bytes],
        upstream: httpx.Response,
        lease: Lease,
        backend: Backend,
        chosen: Candidate,
        shape: PromptShape,
    ) -> AsyncIterator[bytes]:
        """The backend's bytes as they come; the load is released however the response ends."""
        streaming = upstream.headers.get("content-type", "").startswith("text/event-stream")
        scanner = UsageScanner(_MESSAGES_STREAM_END if shape == MESSAGES else _OPENAI_STREAM_END)
        body = bytearray()
        failure: str | None = None
        try:
            if first is not None:
                async for chunk in _prepend(first, chunks):
                    if streaming:
                        scanner.feed(chunk)
                    elif upstream.status_code == 200:
                        body += chunk
                    yield chunk
        except httpx.TransportError as exc:  # too late to retry: the client has bytes already
            failure = f"{type(exc).__name__}: {exc}"
        finally:
            lease.release()
            await upstream.aclose()
        if failure is not None and not scanner.done:
            logger.warning("backend %s failed mid-response: %s", backend.url, failure)
            self.metrics.broken_responses.labels(backend.url).inc()
            if not (streaming and scanner.between_events):
                raise BackendBrokeOff(f"backend {backend.url} failed mid-response: {failure}")
            yield _stream_failure(shape, f"the backend failed mid-response: {failure}")
            return
        usage = scanner.usage if streaming else _json_usage(bytes(body))
        self._observe(backend, chosen, usage, shape)

    def _observe(self, backend: Backend, chosen: Candidate, usage: dict[str, Any] | None, shape: PromptShape) -> None:
        if not usage:
            return
        if shape == MESSAGES:
            counts = [usage.get(f) for f in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")]
            if all(isinstance(count, int) for count in counts):
                self.metrics.observe_usage(backend.url, chosen.retained_tokens, sum(counts), counts[2])
            return
        details = usage.get("prompt_tokens_details") or {}
        cached, prompt = details.get("cached_tokens"), usage.get("prompt_tokens")
        if isinstance(cached, int) and isinstance(prompt, int):
            self.metrics.observe_usage(backend.url, chosen.cached_tokens, prompt, cached)

    @staticmethod
    def _response_headers(upstream: httpx.Response, backend: Backend) -> dict[str, str]:
        """The backend's headers but its request id, the router's own (the same one: the router sent it)."""
        headers = {k: v for k, v in forwarded_headers(upstream.headers).items() if k.lower() != REQUEST_ID_HEADER}
        return {**headers, BACKEND_HEADER: backend.url}


def _backend_headers(request: Request) -> dict[str, str]:
    """The client's end-to-end headers, with the request id the router gave the request."""
    return {**forwarded_headers(request.headers), REQUEST_ID_HEADER: record_of(request.scope).request_id}


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in rest:
        yield chunk


class _Retry(Exception):
    """A backend answered with a server error while another attempt remains."""


def _stream_failure(shape: PromptShape, message: str) -> bytes:
    """The events that end a stream the backend broke off between events, as the server ends one whose engine
    died: Anthropic's ``error`` event on ``/v1/messages``, else OpenAI's error chunk and ``[DONE]``."""
    if shape == MESSAGES:
        return anthropic.event(anthropic.error_body(500, message)).encode()
    error = error_body(message, type="server_error")
    return f"data: {json.dumps(error, separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode()


def _json_usage(body: bytes) -> dict[str, Any] | None:
    try:
        usage = json.loads(body).get("usage")
    except (ValueError, AttributeError, RecursionError):
        return None
    return usage if isinstance(usage, dict) else None
