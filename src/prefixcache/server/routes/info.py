"""What the server is and how it is doing: models, version, health, Prometheus metrics."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from prefixcache.server.routes.state import Engine, Settings

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request, engine: Engine, settings: Settings) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": request.app.state.started,
                "owned_by": "prefixcache",
                "root": name,
                "max_model_len": engine.info.max_model_len,
                "vocab_size": engine.info.vocab_size,
            }
            for name in settings.served_model_names
        ],
    }


@router.get("/version")
async def get_version() -> dict[str, str]:
    return {"version": version("prefixcache")}


@router.get("/health")
async def health(engine: Engine) -> Response:
    return Response(status_code=200 if engine.accepting else 503)


@router.get("/metrics")
async def metrics(engine: Engine) -> Response:
    return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)
