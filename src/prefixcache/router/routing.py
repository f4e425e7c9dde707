"""One routing decision: read the request's prompt once, score the backends, account the load.

The prompt is tokenized and hashed only when the policy uses the index. A backend without KV events
is predicted to hold nothing, so among such backends the prefix policy ranks by load alone. When the
backends make each API key a tenant, the prompt is salted as they salt it, from the client's bearer token;
a request without one is routed by load (the backend will refuse it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from prefixcache.router.backends import Backend, BackendPool
from prefixcache.router.index import PrefixIndex
from prefixcache.router.policy import Candidate, RoutingPolicy
from prefixcache.router.prompt import PromptHasher, PromptKey, PromptTooLong, cache_salt, requested_output_tokens
from prefixcache.server.tenants import bearer_token, engine_salt, tenant_salt


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """``key`` is None when the router did not read the prompt (load-only policy, or a body it cannot parse).
    ``refusal`` is the error the router answers itself (400) instead of routing: a prompt too long for the
    context."""

    key: PromptKey | None
    output_tokens: int
    refusal: str | None = None


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


class Router:
    def __init__(self, pool: BackendPool, index: PrefixIndex, policy: RoutingPolicy, tokenizer: Any) -> None:
        self.pool = pool
        self.index = index
        self.policy = policy
        self.tokenizer = tokenizer
        self._hasher: PromptHasher | None = None
        # One worker: requests are tokenized in turn, never by two threads sharing the tokenizer at once (the
        # tokenizer lets go of the GIL while it works, so the event loop keeps serving meanwhile).
        self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-tokenize")

    def close(self) -> None:
        self._tokenize.shutdown(wait=False, cancel_futures=True)

    async def plan(self, body: dict[str, Any] | None, chat: bool, authorization: str | None) -> RoutePlan:
        """``authorization`` is the client's header, which keyed backends salt the prompt by."""
        if body is None:
            return RoutePlan(None, 0)
        output_tokens = requested_output_tokens(body, chat)
        hasher = self._prompt_hasher()
        if not self.policy.uses_prefix or hasher is None:
            return RoutePlan(None, output_tokens)
        tenant = None
        if hasher.keyed:
            api_key = bearer_token(authorization)
            if api_key is None:
                return RoutePlan(None, output_tokens)
            tenant = tenant_salt(api_key)
        salt = engine_salt(tenant, cache_salt(body))
        # Tokenizing a long prompt or a chat template takes milliseconds: keep the event loop serving.
        loop = asyncio.get_running_loop()
        try:
            key = await loop.run_in_executor(self._tokenize, _prompt_key, hasher, body, chat, salt)
        except PromptTooLong as exc:
            return RoutePlan(None, output_tokens, str(exc))
        return RoutePlan(key, output_tokens)

    def choose(self, plan: RoutePlan, exclude: Collection[str] = ()) -> tuple[Backend, Candidate] | None:
        """The policy's pick among routable backends not in ``exclude`` (URLs); None when there is none."""
        backends = [b for b in self.pool.routable() if b.url not in exclude]
        if not backends:
            return None
        key = plan.key
        matched = {}
        if key is not None:
            with_events = [b.url for b in backends if b.subscriber is not None]
            matched = self.index.matched_blocks(key.block_hashes, with_events)
        block_size = self.pool.reference.block_size if self.pool.reference else 0
        num_tokens = key.num_tokens if key is not None else 0
        candidates = [
            Candidate(b.url, num_tokens, matched.get(b.url, 0) * block_size, b.tokens_in_flight, b.requests_in_flight)
            for b in backends
        ]
        chosen = self.policy.choose(candidates)
        return backends[candidates.index(chosen)], chosen

    def admit(self, backend: Backend, plan: RoutePlan, chosen: Candidate) -> Lease:
        block_hashes = plan.key.block_hashes if plan.key is not None else []
        return Lease(backend, chosen.tokens_to_compute + plan.output_tokens, self.index, block_hashes)

    def _prompt_hasher(self) -> PromptHasher | None:
        if self._hasher is None and self.pool.reference is not None:
            self._hasher = PromptHasher(self.tokenizer, self.pool.reference)
        return self._hasher


def _prompt_key(hasher: PromptHasher, body: dict[str, Any], chat: bool, salt: str | None) -> PromptKey | None:
    token_ids = hasher.token_ids(body, chat)
    if not token_ids:
        return None
    try:
        return hasher.key(token_ids, salt)
    except ValueError:  # ids the engine refuses too: it will answer the error
        return None
