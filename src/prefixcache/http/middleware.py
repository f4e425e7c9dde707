"""The server's plain ASGI middleware: request ids and the log line, API keys as tenants, the body cap.

Plain ASGI (not ``BaseHTTPMiddleware``), so streaming and disconnect detection pass through untouched.
Outermost first: ``RequestContextMiddleware`` (request id, catch-all 500, one log line per request),
``APIKeyMiddleware`` (401 before the body is read), ``BodyLimitMiddleware`` (413 before JSON parsing).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixcache.core.tenant_salt import tenant_salt
from prefixcache.http.auth import BEARER, authorization
from prefixcache.http.protocol import error_response

logger = logging.getLogger(__name__)
request_logger = logging.getLogger("prefixcache.server.requests")

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128
_VALID_REQUEST_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_REQUEST_ID_CHARS}}}")
UNLOGGED_PATHS = frozenset({"/health", "/metrics"})  # probed and scraped every few seconds
_MAX_LOGGED_ERROR_BODY = 4096


@dataclass(slots=True)
class RequestRecord:
    """What one HTTP request did: filled in while it is served, logged as one line when it ends."""

    request_id: str
    method: str
    path: str
    start: float
    status: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    generated_tokens: int | None = None
    first_token_time: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    error: str | None = None

    def line(self, end: float) -> str:
        parts = [f"request_id={self.request_id}", self.method, self.path, str(self.status)]
        if self.prompt_tokens is not None:
            parts += [
                f"prompt_tokens={self.prompt_tokens}",
                f"cached_tokens={self.cached_tokens}",
                f"generated_tokens={self.generated_tokens}",
            ]
        if self.first_token_time is not None:
            parts.append(f"ttft={self.first_token_time - self.start:.3f}s")
        parts.append(f"e2e={end - self.start:.3f}s")
        if self.finish_reasons:
            parts.append(f"finish={','.join(self.finish_reasons)}")
        if self.error is not None:
            parts.append(f"error={json.dumps(self.error)}")
        return " ".join(parts)


def record_of(scope: Scope) -> RequestRecord:
    return scope["state"]["record"]


def tenant_of(scope: Scope) -> str | None:
    """The cache salt of the request's API key; None without keys or with ``--share-cache-across-keys``."""
    return scope["state"].get("tenant")


class RequestContextMiddleware:
    """Gives every request an id (``X-Request-Id`` when the client sends a valid one, else a new one) that the
    response echoes, turns an unhandled exception into an OpenAI-shaped 500 (the traceback goes to the log),
    and logs one line per finished request: id, status, tokens, TTFT, and the error message of a failure."""

    def __init__(self, app: ASGIApp, log_requests: bool = True) -> None:
        self.app = app
        self.log_requests = log_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(REQUEST_ID_HEADER)
        valid = given is not None and _VALID_REQUEST_ID.fullmatch(given) is not None
        record = RequestRecord(given if valid else uuid.uuid4().hex, scope["method"], scope["path"], time.monotonic())
        scope.setdefault("state", {})["record"] = record
        error_body: list[bytes] = []

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                MutableHeaders(scope=message).append(REQUEST_ID_HEADER, record.request_id)
            elif message["type"] == "http.response.body" and (record.status or 0) >= 400:
                error_body.append(message.get("body", b"")[:_MAX_LOGGED_ERROR_BODY])
                if not message.get("more_body"):
                    record.error = record.error or _error_message(b"".join(error_body))
            await send(message)

        try:
            if given is not None and not valid:
                message = f"X-Request-Id must be 1 to {MAX_REQUEST_ID_CHARS} letters, digits, '.', '_', ':' or '-'"
                await error_response(400, message, param="X-Request-Id")(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("request %s failed", record.request_id)
            if record.status is not None:
                raise  # the response has started: the server closes the connection
            message = f"internal server error (request id {record.request_id})"
            await error_response(500, message, type="server_error")(scope, receive, send_with_id)
        finally:
            if self.log_requests and record.path not in UNLOGGED_PATHS:
                request_logger.info("%s", record.line(time.monotonic()))


def _error_message(body: bytes) -> str | None:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return None


class APIKeyMiddleware:
    """Bearer auth on every path except /health, which load balancers probe without credentials; a request
    without ``Authorization`` may send the key as ``x-api-key`` (Anthropic's header, which its SDK sends).

    Each key is a tenant: its requests get the key's cache salt (``tenant_salt``), so tenants never share
    cached blocks, unless ``share_cache`` (``--share-cache-across-keys``). With ``metrics_key``
    (``--metrics-api-key``), /metrics takes that key alone and that key nothing else: a tenant cannot read the
    server-wide counters that would show other tenants' hits. Keys are kept only as digests and compared in
    constant time; a bad key is refused before the body is read.
    """

    def __init__(
        self, app: ASGIApp, api_keys: tuple[str, ...], share_cache: bool = False, metrics_key: str | None = None
    ) -> None:
        self.app = app
        self._tenants = [(_digest(f"{BEARER}{key}"), None if share_cache else tenant_salt(key)) for key in api_keys]
        self._metrics = None if metrics_key is None else _digest(f"{BEARER}{metrics_key}")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = _digest(authorization(Headers(scope=scope)))
            if scope["path"] == "/metrics" and self._metrics is not None:
                if not secrets.compare_digest(given, self._metrics):
                    await _unauthorized("/metrics needs the metrics key (--metrics-api-key)")(scope, receive, send)
                    return
            elif self._tenants:
                matches = [salt for digest, salt in self._tenants if secrets.compare_digest(given, digest)]
                if not matches:
                    message = "Incorrect or missing API key; send 'Authorization: Bearer <key>' or 'x-api-key: <key>'."
                    await _unauthorized(message)(scope, receive, send)
                    return
                scope.setdefault("state", {})["tenant"] = matches[0]
        await self.app(scope, receive, send)


def _unauthorized(message: str) -> ASGIApp:
    return error_response(401, message, headers={"WWW-Authenticate": "Bearer"}, code="invalid_api_key")


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


class BodyLimitMiddleware:
    """Refuses a request body over ``max_bytes`` with 413, before anything parses it.

    A too large ``Content-Length`` is refused without reading a byte; a chunked body is read up to the limit
    and refused as soon as it passes it. A body within the limit is read whole here and handed on.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect that streaming handlers wait for
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is larger than {self.max_bytes} bytes (--max-request-bytes)"
        await error_response(413, message, code="request_too_large")(scope, receive, send)
