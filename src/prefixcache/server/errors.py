"""Every error leaves as OpenAI's ``{"error": {"message", "type", "param", "code"}}``, whatever raised it:
a handler's ``APIError``, pydantic's validation, a bad route, a dead engine."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixcache.http.protocol import UNSUPPORTED_FIELD_HINTS, error_body, error_response
from prefixcache.server.async_llm import EngineDeadError


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


def install_error_handlers(app: FastAPI) -> None:
    """Turn each kind of failure into its OpenAI-shaped response (bugs are the middleware's 500)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status_code, **exc.body["error"])

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(EngineDeadError)
    async def _engine_error(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), type="server_error", code="engine_unavailable")


_UNION_MEMBER_NAMES = frozenset({"str", "int", "float", "bool"})


def _location(loc: tuple[Any, ...]) -> str:
    """A field's path as a client wrote it: ``messages.0.content``, without pydantic's union member names."""
    parts = [str(p) for p in loc[1:] if isinstance(p, int) or (p.isidentifier() and p not in _UNION_MEMBER_NAMES)]
    return ".".join(parts) or "body"


def validation_error(exc: RequestValidationError) -> JSONResponse:
    """A 400 naming every refused field once: our own checks' messages first, pydantic's type errors else."""
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
            hint = UNSUPPORTED_FIELD_HINTS.get(str(error["loc"][-1]), "the README's table lists the fields it takes")
            message = f"unsupported parameter: this server does not implement it ({hint})"
        else:
            message = error["msg"].removeprefix("Value error, ")
        messages.setdefault(location, message)
    text = "; ".join(f"{location}: {message}" for location, message in messages.items())
    param = next(iter(messages)).split(".")[0]
    return error_response(400, text, param=None if param == "body" else param)
