"""What the server is and how it is doing: models, version, health, Prometheus metrics, and SGLang's metadata
paths (``/server_info``, ``/model_info`` and their older ``/get_`` names, which sglang-router reads when a
worker joins)."""

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


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(engine: Engine, settings: Settings) -> dict[str, Any]:
    """SGLang's shape, with the fields sglang-router reads: one engine (tensor, data and pipeline parallel
    size 1), no prefill/decode disaggregation; the context and KV capacity in tokens."""
    info = engine.info
    return {
        "model_path": engine.config.model,
        "tokenizer_path": engine.config.model,
        "served_model_name": settings.served_model_names[0],
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "load_balance_method": "round_robin",
        "disaggregation_mode": "null",
        "version": version("prefixcache"),
        "is_embedding": False,
        "context_length": info.max_model_len,
        "max_total_tokens": info.kv_capacity_tokens,
        "page_size": info.block_size,
        "disable_radix_cache": not info.enable_prefix_caching,
        "dtype": info.dtype,
        "device": info.device,
    }


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(engine: Engine) -> dict[str, Any]:
    """SGLang's shape: a text-generation model, where its checkpoint and tokenizer live, its architecture."""
    return {
        "model_path": engine.config.model,
        "tokenizer_path": engine.config.model,
        "is_generation": True,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "architectures": [engine.info.architecture],
    }
