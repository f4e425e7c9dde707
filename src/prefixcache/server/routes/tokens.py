"""vLLM's /tokenize and /detokenize: the model's tokenizer as the engine uses it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from prefixcache.http.protocol import DetokenizeRequest, TokenizeRequest
from prefixcache.server.errors import APIError
from prefixcache.server.routes.state import Engine, Settings, apply_chat_template, model_name

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, engine: Engine, settings: Settings) -> dict[str, Any]:
    """vLLM's shape; a prompt is tokenized as the completions endpoint does (with the tokenizer's special
    tokens unless ``add_special_tokens`` is false), messages as the chat endpoint does."""
    model_name(settings, body.model)
    if body.messages is not None:
        tokens = await apply_chat_template(engine, body.messages, body.add_generation_prompt, body.special_tokens)
    else:
        tokens = await engine.tokenize(body.prompt, body.special_tokens)
    return {"count": len(tokens), "max_model_len": engine.info.max_model_len, "tokens": tokens}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, engine: Engine, settings: Settings) -> dict[str, str]:
    model_name(settings, body.model)
    vocab_size = engine.info.vocab_size
    if any(not 0 <= t < vocab_size for t in body.tokens):
        raise APIError(400, f"tokens must be in [0, {vocab_size})", param="tokens")
    return {"prompt": await engine.detokenize(body.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(engine: Engine) -> dict[str, Any]:
    """vLLM's: what a client needs to tokenize like the server through /tokenize and /detokenize (lm-eval's
    remote tokenizer reads the special tokens and the chat template here)."""
    tokenizer = engine.tokenizer
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        "model_max_length": engine.info.max_model_len,
        "vocab_size": engine.info.vocab_size,
        "add_special_tokens": True,  # what /tokenize and the completions endpoint do with a text prompt
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
