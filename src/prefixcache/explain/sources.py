"""Where ``explain`` gets token ids and text: the model's tokenizer, or a running server.

A prefixcache server answers ``POST /v1/cache/lookup`` (its tokens, each token's text, a chat's checkpoint hints
and what its cache holds now), ``GET /v1/cache/config`` (its KV cache groups and a recurrent model's checkpoint
budget and its number of blocks, for the replay) and ``POST
/v1/chat/completions/render`` (where a chat's ``cache_control`` breakpoints land). Any other server with vLLM's
``/tokenize`` (vLLM itself: it takes a completion's ``prompt`` or a chat's ``messages``) gives the tokens it
would run, and ``/detokenize`` their text; it reports no cache state, no block size, no KV cache groups (the
replay assumes one full-attention group there) and no breakpoint positions, so there a chat's ``cache_control``
is not placed (a body's ``retention`` and ``prompt_cache_retention`` are honoured: they need no template).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prefixcache.core import FULL_ATTENTION
from prefixcache.core.kv_cache_groups import spec_of_kind
from prefixcache.core.retention import RetentionRange
from prefixcache.core.state_table import CheckpointPolicy
from prefixcache.explain.log import (
    Decode,
    LineError,
    LoggedBody,
    Prompt,
    Tokenized,
    chat_turns,
    checked_token_ids,
    namespace_of,
    prompt_of,
    tokenize_body,
    tokenize_log,
)
from prefixcache.http.protocol import adds_special_tokens
from prefixcache.http.retention import TokenRangeRetention

if TYPE_CHECKING:
    from prefixcache.model.config import ModelConfig


def through_tokenizer(
    bodies: Sequence[LoggedBody], model: str | None, locate_system: bool = False
) -> tuple[list[Prompt], list[LineError], Decode, str, ModelConfig]:
    """Tokenize with the model's own tokenizer (no weights loaded); ids outside its vocabulary are refused. Also
    the model's config, from which the replay's cache is laid out as an engine would lay it out. A chat of a model
    with recurrent layers gets its message ends as checkpoint hints, as the server gives them. ``locate_system``:
    find where each chat's system messages end (``--breakpoint system``)."""
    from prefixcache.model.loader import load_tokenizer, read_config, resolve_model

    try:
        model_dir, name = resolve_model(model)
        tokenizer = load_tokenizer(model_dir)
        model_config = read_config(model_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"prefixcache explain: {exc}") from exc
    message_ends = bool(model_config.state_layers)
    prompts, errors = tokenize_log(
        bodies, lambda body: tokenize_body(body, tokenizer, model_config.vocab_size, locate_system, message_ends)
    )
    return prompts, errors, lambda ids: tokenizer.decode(list(ids)), name, model_config


def server_client(base_url: str, api_key: str | None) -> Any:
    """An HTTP client for ``--base-url`` (with the Bearer key); the caller closes it."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=60)


def through_server(
    bodies: Sequence[LoggedBody], client: Any
) -> tuple[list[Prompt], list[LineError], Decode, list[int] | None, int | None]:
    """Tokenize every body on the server: prompts, bad lines, the decoder (which asks the server while the client
    is open), what its cache holds of each prompt now and its block size (the last two None for a server without
    prefixcache's lookup, such as vLLM).

    A body the server refuses (400, 422) is a bad line; anything else that fails stops the command.
    """
    with _reaching(client):
        if bodies and client.post("/v1/cache/lookup", json=_lookup_body(bodies[0].body)).status_code in (404, 405):
            return _through_tokenize(client, bodies)  # not a prefixcache server
        return _through_lookup(client, bodies)


def server_cache(client: Any) -> dict[str, Any]:
    """The ``ExplainConfig`` fields of the cache the server reports at /v1/cache/config, for the replay to admit
    as it does: its KV cache groups (one full-attention group for a server that reports none: one from before
    them, or not prefixcache) and, for a model with recurrent layers, its state checkpoints' budget, sparse
    interval and prefill chunk, and its blocks as the replay's capacity (a server from before it reported them:
    none, ``--capacity-tokens`` gives it)."""
    path = "/v1/cache/config"
    with _reaching(client):
        response = client.get(path)
    if response.status_code in (404, 405):
        return {"kv_cache_groups": (FULL_ATTENTION,)}
    answer = _answer(client, response, path)
    groups = []
    for group in answer.get("kv_cache_groups") or []:
        spec = spec_of_kind(group["kind"], group.get("sliding_window"))
        if spec is None:
            raise SystemExit(f"prefixcache explain: cannot replay a KV cache group of kind {group['kind']!r}")
        groups.append(spec)
    cache: dict[str, Any] = {"kv_cache_groups": tuple(groups) or (FULL_ATTENTION,)}
    if groups and groups[-1].recurrent_state:
        state = answer.get("recurrent_state")
        if not state:
            raise SystemExit(f"prefixcache explain: {client.base_url} reports no budget of its state checkpoints")
        cache |= {
            "num_state_slots": state["num_state_slots"],
            "num_checkpoint_slots": state["num_checkpoint_slots"],
            "checkpoint_policy": CheckpointPolicy(sparse_every_blocks=state["sparse_every_blocks"]),
            "max_chunk_tokens": state["max_num_batched_tokens"],
        }
        if answer.get("num_blocks"):
            cache["capacity_tokens"] = answer["num_blocks"] * answer["block_size"]
    return cache


@contextlib.contextmanager
def _reaching(client: Any) -> Iterator[None]:
    """A server that cannot be reached stops the command in one line."""
    import httpx

    try:
        yield
    except httpx.HTTPError as exc:
        raise SystemExit(f"prefixcache explain: cannot reach {client.base_url}: {exc}") from exc


def _through_lookup(
    client: Any, bodies: Sequence[LoggedBody]
) -> tuple[list[Prompt], list[LineError], Decode, list[int], int | None]:
    """prefixcache's lookup: tokens, their texts and the cache's hit for each body."""
    prompts: list[Prompt] = []
    errors: list[LineError] = []
    live_cached: list[int] = []
    texts: dict[int, str] = {}
    block_size = None
    for logged in bodies:
        try:
            namespace_of(logged.body)
            answer = _post(client, "/v1/cache/lookup", _lookup_body(logged.body))
            ids = answer["prompt_token_ids"]
            hints = tuple(answer.get("checkpoint_hints") or ())
            tokenized = Tokenized(ids, _breakpoints(client, logged.body), checkpoint_hints=hints)
            prompt = prompt_of(logged, tokenized, _messages(logged.body))
        except ValueError as exc:
            errors.append(LineError(logged.line, str(exc)))
            continue
        texts.update(zip(ids, answer["prompt_token_texts"], strict=True))
        prompts.append(prompt)
        live_cached.append(answer["cached_tokens"])
        block_size = answer["block_size"]
    return prompts, errors, lambda ids: "".join(texts.get(t, "") for t in ids), live_cached, block_size


def _through_tokenize(
    client: Any, bodies: Sequence[LoggedBody]
) -> tuple[list[Prompt], list[LineError], Decode, None, None]:
    """vLLM's /tokenize (a prompt string, or chat messages with the generation prompt, as its endpoints run them)
    and /detokenize; token ids in the log are checked by /detokenize, so the server refuses what it would."""
    prompts: list[Prompt] = []
    errors: list[LineError] = []
    for logged in bodies:
        body = logged.body
        try:
            namespace_of(body)
            if body.get("prompt_token_ids") is not None or isinstance(body.get("prompt"), list):
                field = "prompt_token_ids" if body.get("prompt_token_ids") is not None else "prompt"
                if body[field] and isinstance(body[field][0], str | list):
                    raise ValueError("a list of prompts: explain takes one prompt per logged request")
                ids = checked_token_ids(body[field], field)
                _post(client, "/detokenize", {"tokens": ids})  # ids the server refuses are a bad line
            elif body.get("messages") is not None:
                chat = {**_chat_input(body), "add_generation_prompt": True, **_special_tokens(body, True)}
                ids = _post(client, "/tokenize", chat)["tokens"]
            elif isinstance(body.get("prompt"), str):
                ids = _post(client, "/tokenize", {"prompt": body["prompt"], **_special_tokens(body, False)})["tokens"]
            else:
                raise ValueError("no prompt: expected prompt, prompt_token_ids or messages")
            if not ids:
                raise ValueError("the prompt is empty")
            prompt = prompt_of(logged, Tokenized(ids), _messages(body))
        except ValueError as exc:
            errors.append(LineError(logged.line, str(exc)))
            continue
        prompts.append(prompt)

    @functools.lru_cache(maxsize=4096)
    def detokenize(ids: tuple[int, ...]) -> str:
        try:
            with _reaching(client):
                return _post(client, "/detokenize", {"tokens": list(ids)})["prompt"]
        except ValueError:  # ids the server cannot decode: shown as nothing rather than losing the report
            return ""

    return prompts, errors, lambda ids: detokenize(tuple(ids)), None, None


def _breakpoints(client: Any, body: dict[str, Any]) -> tuple[RetentionRange, ...]:
    """Where a chat body's ``cache_control`` breakpoints land, as the server's chat render reports them (its
    template places them); none for a body without any. The render is sent the messages and tools alone, so the
    ranges it answers are the breakpoints' (the body's own ``retention`` is ``prompt_of``'s to add)."""
    if not _marked(body.get("messages")) and not _marked(body.get("tools")):
        return ()
    render = _chat_input(body) | _special_tokens(body, True)
    answer = _post(client, "/v1/chat/completions/render", render)
    return tuple(TokenRangeRetention.model_validate(entry).range() for entry in answer.get("retention") or ())


def _marked(items: Any) -> bool:
    """Whether a list of messages or tools carries a ``cache_control`` (on an item or a content part)."""
    if not isinstance(items, list):
        return False
    for item in items:
        if isinstance(item, dict):
            parts = item.get("content") if isinstance(item.get("content"), list) else []
            if "cache_control" in item or any(isinstance(p, dict) and "cache_control" in p for p in parts):
                return True
    return False


def _messages(body: dict[str, Any]) -> tuple[dict[str, str], ...] | None:
    """The chat messages, to tell which one a prompt differs in; None when they are not text the server took."""
    try:
        turns = chat_turns(body)
    except ValueError:
        return None
    return None if turns is None else tuple(turns)


def _special_tokens(body: dict[str, Any], chat: bool) -> dict[str, bool]:
    """The body's ``add_special_tokens`` as the endpoint defaults it, said explicitly: /tokenize tokenizes as
    the endpoint the body was sent to would."""
    return {"add_special_tokens": adds_special_tokens(body, chat)}


def _chat_input(body: dict[str, Any]) -> dict[str, Any]:
    """A chat body's messages and its tools (which the template renders into the prompt)."""
    return {k: body[k] for k in ("messages", "tools") if body.get(k) is not None}


def _lookup_body(body: dict[str, Any]) -> dict[str, Any]:
    """The parts of a logged body the lookup needs (sampling fields would only be validated)."""
    if body.get("prompt_token_ids") is not None:
        prompt: dict[str, Any] = {"prompt": body["prompt_token_ids"]}
    elif body.get("messages") is not None:
        prompt = {**_chat_input(body), **_special_tokens(body, True)}
    else:
        prompt = {"prompt": body.get("prompt"), **_special_tokens(body, False)}
    return {**prompt, "cache_salt": body.get("cache_salt"), "return_token_ids": True}


def _post(client: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    return _answer(client, client.post(path, json=body), path)


def _answer(client: Any, response: Any, path: str) -> dict[str, Any]:
    """The JSON of a 200; ValueError with the server's message for a refused body (400, 422), else SystemExit."""
    if response.status_code in (400, 422):
        raise ValueError(f"the server refused it: {_error_message(response)}")
    if response.status_code != 200:
        raise SystemExit(
            f"prefixcache explain: {client.base_url}{path} answered {response.status_code}: {response.text[:200]}"
        )
    return response.json()


def _error_message(response: Any) -> str:
    """OpenAI's ``{"error": {"message": ...}}``, vLLM's older ``{"message": ...}``, FastAPI's ``{"detail": ...}``."""
    try:
        data = response.json()
    except ValueError:
        return response.text[:200]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail"):
            if key in data:
                return str(data[key])
    return response.text[:200]
