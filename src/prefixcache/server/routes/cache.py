"""The prefix cache itself: what it holds for a prompt now, how it is keyed (for routers), and its reset."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from prefixcache.core.tenant_salt import SALT_BY_API_KEY, engine_salt
from prefixcache.engine.input_processor import PromptInput
from prefixcache.http.middleware import tenant_of
from prefixcache.http.protocol import ChatLookupRequest, lookup_request
from prefixcache.server.errors import APIError
from prefixcache.server.routes.state import Engine, Settings, chat_prompt, model_name

router = APIRouter()
reset_router = APIRouter()  # mounted only with --enable-reset-prefix-cache


@router.post("/v1/cache/lookup")
async def cache_lookup(request: Request, raw: dict[str, Any], engine: Engine, settings: Settings) -> dict[str, Any]:
    """How much of a prompt the prefix cache and its offload tiers hold now for this tenant, the body being
    the one the completions or the chat endpoint takes; runs no model and changes nothing."""
    try:
        body = lookup_request(raw)
    except ValidationError as exc:  # reported like any other body the endpoints refuse
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    model_name(settings, body.model)
    if isinstance(body, ChatLookupRequest):
        chat, _ = await chat_prompt(
            engine, body.template_messages(), body.template_tools(), add_special_tokens=body.add_special_tokens
        )
        prompt: PromptInput = chat["prompt_token_ids"]
        hints = chat.get("checkpoint_hints", [])
    else:
        prompt, hints = body.prompts[0], []
    salt = engine_salt(tenant_of(request.scope), body.cache_salt)
    try:  # a chat's ids are final; a text completion prompt is tokenized as the completions endpoint does
        token_ids, found = await engine.lookup(prompt, salt, body.add_special_tokens)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    answer = asdict(found)
    if body.return_token_ids:
        answer["prompt_token_ids"] = token_ids
        answer["prompt_token_texts"] = await engine.token_texts(token_ids)
        answer["checkpoint_hints"] = hints  # a recurrent model's state checkpoints go there (a chat's message ends)
    return answer


@router.get("/v1/cache/config")
async def cache_config(engine: Engine, settings: Settings) -> dict[str, Any]:
    """How this server keys its prefix cache and where it publishes KV events: what a router needs.

    ``tenant_salt`` is ``"api_key"`` when each API key is a tenant (the engine's salt is ``engine_salt`` of
    the key's ``tenant_salt`` and the body's ``cache_salt``), null when only ``cache_salt`` salts.
    ``kv_cache_groups`` are the KV cache groups in the shape vLLM gives its event consumers (index, kind,
    block size, window), so that a router predicts a hybrid model's hits before any event arrives.
    ``kv_events.endpoint_bound`` false: the publisher connects to ``endpoint``, where a subscriber must bind.
    ``recurrent_state`` (null without recurrent layers): the state checkpoints' budget and where prefill chunks
    end, what ``explain --base-url`` needs to replay them, with ``num_blocks`` (the pool's blocks, the null block
    included, as the cache manager counts them) the size of the replay's cache."""
    info = engine.info
    keyed = bool(settings.api_keys) and not settings.share_cache_across_keys
    events = engine.config.kv_events_config
    publishing = events is not None and events.enable_kv_cache_events and events.publisher == "zmq"
    return {
        "model": settings.served_model_names[0],
        "max_model_len": info.max_model_len,
        "block_size": info.block_size,
        "num_blocks": info.num_blocks,
        "hash_algo": info.hash_algo,
        "hash_seed": info.hash_seed,
        "enable_prefix_caching": info.enable_prefix_caching,
        "tenant_salt": SALT_BY_API_KEY if keyed else None,
        "kv_cache_groups": [
            {"group_idx": g, "kind": spec.kind, "block_size": info.block_size, "sliding_window": spec.sliding_window}
            for g, spec in enumerate(info.kv_cache_groups)
        ],
        "recurrent_state": (
            {
                "num_state_slots": info.num_state_slots,
                "num_checkpoint_slots": info.num_checkpoint_slots,
                "sparse_every_blocks": info.sparse_every_blocks,
                "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            }
            if any(spec.recurrent_state for spec in info.kv_cache_groups)
            else None
        ),
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


@reset_router.post("/reset_prefix_cache")
async def reset_prefix_cache(engine: Engine) -> dict[str, bool]:
    """Drops every tenant's cached prefixes; refused (success false) while any block is in use."""
    return {"success": await engine.reset_prefix_cache()}
