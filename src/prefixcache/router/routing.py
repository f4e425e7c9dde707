"""One routing decision: read the request's prompt once, score the backends, account the load.

The prompt is tokenized and hashed only when the policy uses the index: into the engine's own keys for
``prefixcache serve`` backends, into the router's content keys for the others (content-keyed by their
events, or routed by load). A backend without KV events is predicted to hold nothing, so among such
backends the prefix policy ranks by load and affinity alone. When the prefixcache backends make each API
key a tenant, the prompt is salted as they salt it, from the client's bearer token; a request without one
is routed by load there (the backend will refuse it). A request's ``cache_salt`` is part of both keys; a
content-keyed backend's salted blocks are never indexed (see :mod:`~prefixcache.router.blocks`), so a
salted request finds nothing cached there and is routed by load.

The affinity key is the request's ``prompt_cache_key`` when it has one, else the hash of its
``AFFINITY_BLOCKS``-th block (or its last whole block when shorter): deep enough to tell tenants' system
prompts apart, shallow enough that the turns of one conversation keep it. Backends are ranked for it by
rendezvous hashing of the key with each backend's URL, so router replicas listing the same backends agree.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xxhash

from prefixcache.core.tenant_salt import engine_salt, tenant_salt
from prefixcache.http.auth import bearer_token
from prefixcache.router.backends import CONTENT, ENGINE, LOAD, Backend, BackendPool
from prefixcache.router.index import PrefixIndex
from prefixcache.router.policy import Candidate, RoutingPolicy
from prefixcache.router.prompt import (
    COMPLETION,
    PromptHasher,
    PromptKey,
    PromptShape,
    PromptTooLong,
    cache_salt,
    prompt_cache_key,
    requested_output_tokens,
)

AFFINITY_BLOCKS = 4


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """A key is None where the router did not read the prompt (load-only policy, a body it cannot parse, no
    backend of that kind): ``engine_key`` for prefixcache backends, ``content_key`` for the others.
    ``affinity`` is the request's affinity key (None: none). ``refusal`` is the error the router answers itself
    (400) instead of routing: a prompt too long for the context of every backend in the rotation."""

    engine_key: PromptKey | None
    content_key: PromptKey | None
    affinity: bytes | None
    output_tokens: int
    refusal: str | None = None

    def key_for(self, backend: Backend) -> PromptKey | None:
        """The key ``backend``'s index entries are matched by; None when it has no events."""
        if backend.subscriber is None:
            return None
        return self.engine_key if backend.kind == ENGINE else self.content_key

    @property
    def num_tokens(self) -> int:
        key = self.engine_key or self.content_key
        return key.num_tokens if key is not None else 0


class Lease:
    """A request's share of a backend's load and its prompt's place in the index, from routing until its
    response ends; released once."""

    def __init__(self, backend: Backend, tokens: int, index: PrefixIndex, block_hashes: Sequence[int]) -> None:
        self.backend = backend
        self.tokens = tokens
        self._index = index
        self._block_hashes = block_hashes
        backend.tokens_in_flight += tokens
        backend.requests_in_flight += 1
        index.hold(backend.url, block_hashes)
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.backend.tokens_in_flight -= self.tokens
            self.backend.requests_in_flight -= 1
            self._index.release(self.backend.url, self._block_hashes)
            self.backend.finished(bool(self._block_hashes))


class Router:
    def __init__(self, pool: BackendPool, index: PrefixIndex, policy: RoutingPolicy, tokenizer: Any) -> None:
        self.pool = pool
        self.index = index
        self.policy = policy
        self.tokenizer = tokenizer
        self._engine_hasher: PromptHasher | None = None
        self._content_hasher = PromptHasher.by_content(tokenizer, pool.content_block_size)
        # One worker: requests are tokenized in turn, never by two threads sharing the tokenizer at once (the
        # tokenizer lets go of the GIL while it works, so the event loop keeps serving meanwhile).
        self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-tokenize")

    def close(self) -> None:
        self._tokenize.shutdown(wait=False, cancel_futures=True)

    async def plan(self, body: dict[str, Any] | None, shape: PromptShape, authorization: str | None) -> RoutePlan:
        """``authorization`` is the client's key as a bearer header (``http.auth.authorization``), which keyed
        backends salt the prompt by."""
        if body is None:
            return RoutePlan(None, None, None, 0)
        output_tokens = requested_output_tokens(body, shape)
        if not self.policy.uses_prefix:
            return RoutePlan(None, None, None, output_tokens)
        routable = self.pool.routable()
        kinds = {b.kind for b in routable}
        engine_hasher = self._engine_prompt_hasher() if ENGINE in kinds else None
        engine = None
        if engine_hasher is not None:
            tenant = None
            if engine_hasher.keyed:
                api_key = bearer_token(authorization)
                tenant = tenant_salt(api_key) if api_key is not None else None
            if tenant is not None or not engine_hasher.keyed:
                engine = (engine_hasher, engine_salt(tenant, cache_salt(body)))
        content = None
        if kinds & {CONTENT, LOAD}:
            model = body.get("model")
            loras = set().union(*(b.lora_names for b in routable))
            lora = model if isinstance(model, str) and model in loras else None
            content = (self._content_hasher, cache_salt(body), lora)
        # Tokenizing a long prompt or a chat template takes milliseconds: keep the event loop serving.
        loop = asyncio.get_running_loop()
        try:
            keys = await loop.run_in_executor(self._tokenize, _prompt_keys, body, shape, engine, content)
        except PromptTooLong as exc:
            return RoutePlan(None, None, None, output_tokens, str(exc))
        engine_key, content_key = keys
        return RoutePlan(engine_key, content_key, _affinity(body, content_key or engine_key), output_tokens)

    def choose(self, plan: RoutePlan, exclude: Collection[str] = ()) -> tuple[Backend, Candidate] | None:
        """The policy's pick among routable backends not in ``exclude`` (URLs); None when there is none."""
        backends = [b for b in self.pool.routable() if b.url not in exclude]
        if not backends:
            return None
        ranks = _affinity_ranks(plan.affinity, backends)
        candidates = []
        for b in backends:
            key = plan.key_for(b)
            matched = self.index.matched_blocks(key.block_hashes, [b.url])[b.url] if key is not None else 0
            prompt_tokens = key.num_tokens if key is not None else plan.num_tokens
            block_size = self._block_size(b)
            held = self.index.gpu_blocks(b.url) * block_size
            retained = self.index.retained_run(b.url, key.block_hashes[:matched]) if key is not None else 0
            candidates.append(
                Candidate(
                    b.url,
                    prompt_tokens,
                    matched * block_size,
                    b.tokens_in_flight,
                    b.requests_in_flight,
                    ranks.get(b.url),
                    held,
                    retained * block_size,
                )
            )
        chosen = self.policy.choose(candidates)
        return backends[candidates.index(chosen)], chosen

    def admit(self, backend: Backend, plan: RoutePlan, chosen: Candidate) -> Lease:
        key = plan.key_for(backend)
        block_hashes = key.block_hashes if key is not None else []
        return Lease(backend, chosen.tokens_to_compute + plan.output_tokens, self.index, block_hashes)

    def _block_size(self, backend: Backend) -> int:
        if backend.kind == ENGINE:
            return self.pool.reference.block_size if self.pool.reference else 0
        return self.pool.content_block_size

    def _engine_prompt_hasher(self) -> PromptHasher | None:
        if self._engine_hasher is None and self.pool.reference is not None:
            self._engine_hasher = PromptHasher.for_engine(self.tokenizer, self.pool.reference)
        return self._engine_hasher


def _prompt_keys(
    body: dict[str, Any],
    shape: PromptShape,
    engine: tuple[PromptHasher, str | None] | None,
    content: tuple[PromptHasher, str | None, str | None] | None,
) -> tuple[PromptKey | None, PromptKey | None]:
    """The engine key (hasher, salt) and the content key (hasher, salt, LoRA) asked for; token ids are shared
    unless the two tokenize differently (a text completion prompt: vLLM adds special tokens).

    A prompt too long for the engines' context raises PromptTooLong when they are all there is; beside
    content-keyed backends, whose context the router does not know, it is only left unhashed for the engines."""
    engine_ids, too_long = None, False
    if engine is not None:
        try:
            engine_ids = engine[0].token_ids(body, shape)
        except PromptTooLong:
            if content is None:
                raise
            too_long = True
    engine_key = _prompt_key(engine[0], engine_ids, engine[1]) if engine is not None else None
    if content is None:
        return engine_key, None
    hasher, salt, lora = content
    text_prompt = shape == COMPLETION and isinstance(body.get("prompt"), str)
    shared = engine is not None and not too_long and not text_prompt
    content_ids = engine_ids if shared else hasher.token_ids(body, shape)
    return engine_key, _prompt_key(hasher, content_ids, salt, lora)


def _prompt_key(
    hasher: PromptHasher, token_ids: list[int] | None, salt: str | None, lora: str | None = None
) -> PromptKey | None:
    if not token_ids:
        return None
    try:
        return hasher.key(token_ids, salt, lora)
    except ValueError:  # ids the engine refuses too: it will answer the error
        return None


def _affinity(body: dict[str, Any], key: PromptKey | None) -> bytes | None:
    """The request's affinity key: its prompt_cache_key, else its AFFINITY_BLOCKS-th block's hash."""
    explicit = prompt_cache_key(body)
    if explicit is not None:
        return b"prompt_cache_key:" + explicit.encode("utf-8", "surrogatepass")
    if key is None or not key.block_hashes:
        return None
    depth = min(len(key.block_hashes), AFFINITY_BLOCKS)
    return b"prefix:" + key.block_hashes[depth - 1].to_bytes(8, "big")


def _affinity_ranks(affinity: bytes | None, backends: Sequence[Backend]) -> dict[str, int]:
    """Rendezvous hashing: each backend's place (0 first) in the key's order, the same in every router."""
    if affinity is None:
        return {}
    order = sorted(backends, key=lambda b: xxhash.xxh64_intdigest(affinity + b.url.encode()), reverse=True)
    return {b.url: rank for rank, b in enumerate(order)}
