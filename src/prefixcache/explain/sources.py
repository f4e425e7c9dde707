"""Where ``explain`` gets token ids and text: the model's tokenizer, or a running server's lookup endpoint."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefixcache.core import KVCacheGroupSpec
from prefixcache.explain.log import Decode, LineError, LoggedBody, Prompt, namespace_of, token_ids_of, tokenize_log


def through_tokenizer(
    bodies: Sequence[LoggedBody], model: str | None
) -> tuple[list[Prompt], list[LineError], Decode, str, tuple[KVCacheGroupSpec, ...]]:
    """Tokenize with the model's own tokenizer (no weights loaded); also the KV cache groups an engine would
    give the model, for the replay."""
    from prefixcache.model.loader import load_tokenizer, read_config, resolve_model

    try:
        model_dir, name = resolve_model(model)
        tokenizer = load_tokenizer(model_dir)
        groups = tuple(KVCacheGroupSpec(group.sliding_window) for group in read_config(model_dir).kv_cache_groups())
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"prefixcache explain: {exc}") from exc
    prompts, errors = tokenize_log(bodies, lambda body: token_ids_of(body, tokenizer))
    return prompts, errors, lambda ids: tokenizer.decode(list(ids)), name, groups


def through_server(
    bodies: Sequence[LoggedBody], base_url: str, api_key: str | None
) -> tuple[list[Prompt], list[LineError], Decode, list[int], int | None]:
    """Look every body up on the server: its tokens, each token's text, and what its cache holds now.

    A body the server refuses (400) is a bad line; anything else that fails stops the command.
    """
    import httpx

    prompts: list[Prompt] = []
    errors: list[LineError] = []
    live_cached: list[int] = []
    texts: dict[int, str] = {}
    block_size = None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=60) as client:
        for logged in bodies:
            try:
                salt, lora = namespace_of(logged.body)
                answer = _server_lookup(client, _lookup_body(logged.body))
            except ValueError as exc:
                errors.append(LineError(logged.line, str(exc)))
                continue
            ids = answer["prompt_token_ids"]
            texts.update(zip(ids, answer["prompt_token_texts"], strict=True))
            prompts.append(Prompt(logged.line, ids, salt, lora))
            live_cached.append(answer["cached_tokens"])
            block_size = answer["block_size"]
    return prompts, errors, lambda ids: "".join(texts.get(t, "") for t in ids), live_cached, block_size


def _lookup_body(body: dict[str, Any]) -> dict[str, Any]:
    """The parts of a logged body the lookup needs (sampling fields would only be validated)."""
    if body.get("prompt_token_ids") is not None:
        prompt: dict[str, Any] = {"prompt": body["prompt_token_ids"]}
    elif body.get("messages") is not None:
        prompt = {"messages": body["messages"]}
    else:
        prompt = {"prompt": body.get("prompt")}
    return {**prompt, "cache_salt": body.get("cache_salt"), "return_token_ids": True}


def _server_lookup(client: Any, body: dict[str, Any]) -> dict[str, Any]:
    import httpx

    try:
        response = client.post("/v1/cache/lookup", json=body)
    except httpx.HTTPError as exc:
        raise SystemExit(f"prefixcache explain: cannot reach {client.base_url}: {exc}") from exc
    if response.status_code == 400:
        raise ValueError(f"the server refused it: {response.json()['error']['message']}")
    if response.status_code != 200:
        raise SystemExit(
            f"prefixcache explain: {client.base_url}/v1/cache/lookup answered {response.status_code}: "
            f"{response.text[:200]}"
        )
    return response.json()
