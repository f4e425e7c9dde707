"""Why a request log's prompts hit or miss the prefix cache, computed from the prompts alone.

Requests are taken in log order, each holding its blocks until the next arrives, and only prompt tokens are
cached (generated tokens are not in the log). The replay honours each request's retention directives
(``Prompt.retention``) with the engine's default bounds; its TTLs are timed by the log's timestamps when every
request has one (a request's TTL runs from the next one's arrival, when the replay frees it), and without them
no time passes, so no TTL ends and a directive acts by its priority alone. ``ExplainConfig.breakpoint`` adds a
what-if: the same replay with that breakpoint added to every request. For every request:

* the earlier request of the same namespace (cache salt and LoRA) it shares the longest prefix
  with, and how long that prefix is: an infinite, token-exact cache would reuse all of it but the
  last prompt token, which is always computed;
* the hit at the engine's block size, where only whole blocks are reused: the difference is the
  alignment loss;
* with a capacity, the hit the real :class:`~prefixcache.core.KVCacheManager` gives when the log is
  replayed through it; what an infinite cache would have reused beyond that was evicted;
* where it parts from that earlier prompt, the text on both sides, and whether the prompts agree
  again after a short span (a varying field such as a time stamp or a request id), after one side's
  extra tokens (a section added or reordered), or not at all nearby (their own content); the text
  around the differing span, marked ``…before ⟦span⟧ after…`` so a prompt author can find it, and for
  a chat, which message it is in.

Missed prompt tokens get one reason each, a refinement of one of the engine's own reasons
(:mod:`prefixcache.core.miss`, which ``/metrics`` and ``/v1/cache/lookup`` report), so the totals by core
reason are what the engine would count replaying the log:

* ``new`` splits into ``never_seen`` (no earlier request had the next block) and ``different_salt``
  (an earlier request with another salt or LoRA had it);
* ``evicted`` (with a capacity: the first missing block was cached before and evicted) splits into
  ``evicted`` (what an infinite cache would have reused) and ``after_evicted`` (the hittable tokens after
  those, never seen: a larger cache serves the evicted part only); ``expired`` (the block left after its
  retention TTL ended) and ``evicted_below_retained`` (a plain block lost to free retained ones) split the
  same way, into themselves and ``after_expired`` / ``after_evicted_below_retained``, by the cause the replay's
  pool gave the eviction;
* ``partial_block`` splits into ``shorter_than_block`` (the prompt does not fill one block beyond its last
  token) and ``tail`` (after the last whole block a lookup may return);
* ``no_checkpoint`` (a model with recurrent layers): the attention groups held these blocks right after the hit,
  but no state checkpoint lies where the prompt parts from the cached path, so they were computed again. A
  checkpoint there would have saved exactly them: the report's what-if, per request and in total.

On a model with recurrent layers (``ExplainConfig.num_checkpoint_slots``: Qwen3.5, Granite 4.0-H, LFM2) the replay
is what tells the hit: its manager has the recurrent-state group, its checkpoint budget and policy as the engine
sizes them (``engine/cache_layout.py``), prefills in the engine's chunks, and takes each prompt's checkpoint hints
(a chat's message ends); so such a model needs a capacity (the command gives it the engine's default memory). As
the log holds no outputs, a request's finish checkpoint stays at its prompt's last full block, where the engine
moves it on as a reply fills blocks: the replay matches the engine exactly for requests that decode no whole block
(``max_tokens`` short of one, as in the tests), and may find a checkpoint there that the engine had moved on.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from prefixcache.core import EVICTION_POLICIES, FULL_ATTENTION, HASH_ALGOS, KVCacheGroupSpec, KVCacheManager, Request
from prefixcache.core.block_pool import EVICTED, EVICTION_CAUSES
from prefixcache.core.kv_cache_groups import check_groups
from prefixcache.core.miss import MISS_REASONS, hittable_tokens
from prefixcache.core.retention import RetentionRange
from prefixcache.core.state_table import DEFAULT_CHECKPOINT_POLICY, CheckpointPolicy
from prefixcache.explain.log import Decode, Prompt
from prefixcache.http.retention import BREAKPOINT_PRIORITY, TTL_SECONDS
from prefixcache.replay import HeldCache

# Two prompts "agree again" when SYNC_TOKENS tokens match; a varying field is at most MAX_SPAN_TOKENS long.
SYNC_TOKENS = 8
MAX_SPAN_TOKENS = 64
# How many prompts sharing a head are compared to find where a varying span ends.
MAX_RESYNC_PROMPTS = 200
# Divergence points are grouped in windows of this many tokens to find where most prompts part.
CLUSTER_TOKENS = 16
TEXT_CHARS = 40

# Each of explain's reasons and the core reason it refines, in the order the report lists them.
REFINES = {
    "no_checkpoint": "no_checkpoint",  # first in a prompt: right after the hit
    "never_seen": "new",
    "different_salt": "new",
    # An eviction's reason by its cause, under the same name (what an infinite cache would have reused), then
    # the hittable tokens after those.
    **{name: cause for cause in EVICTION_CAUSES for name in (cause, f"after_{cause}")},
    "shorter_than_block": "partial_block",
    "tail": "partial_block",
}
REASONS = tuple(REFINES)
CORE_REASON_LABELS = {
    "new": "new: a larger cache would not help",
    "evicted": "evicted: a larger cache would help",
    "expired": "expired: a longer TTL would help",
    "evicted_below_retained": "evicted_below_retained: lost to retained",
    "partial_block": "partial_block: smaller blocks help",
    "skipped": "skipped: the cache is not read",
    "no_checkpoint": "no_checkpoint: a checkpoint would help",
}
REASON_LABELS = {
    "no_checkpoint": "blocks cached, no state checkpoint",
    "never_seen": "never seen",
    "different_salt": "different salt or LoRA",
    "evicted": "an infinite cache would reuse",
    "after_evicted": "never seen, after evicted blocks",
    "expired": "an infinite cache would reuse",
    "after_expired": "never seen, after expired blocks",
    "evicted_below_retained": "an infinite cache would reuse",
    "after_evicted_below_retained": "never seen, after them",
    "shorter_than_block": "shorter than one block",
    "tail": "tail after the last whole block",
}
assert set(REFINES.values()) <= set(MISS_REASONS) == set(CORE_REASON_LABELS)
KINDS = {
    "varying": "a short span differs, then the prompts agree again",
    "inserted": "one prompt has extra tokens (a section added, dropped or reordered), then they agree again",
    "differs": "the prompts differ from here on",
}


@dataclass(frozen=True, slots=True)
class WhatIfBreakpoint:
    """A ``cache_control`` breakpoint to add to every request: after its leading system messages (``at`` is
    ``"system"``; requests without one get none) or after its first ``at`` tokens (the whole prompt when it is
    shorter), with Anthropic's ``ttl`` (``5m`` or ``1h``, at the server's priority for it)."""

    at: str | int
    ttl: str = "5m"

    def __post_init__(self) -> None:
        if self.at != "system" and (isinstance(self.at, bool) or not isinstance(self.at, int) or self.at <= 0):
            raise ValueError(f"a breakpoint is 'system' or a positive number of tokens, got {self.at!r}")
        if self.ttl not in TTL_SECONDS:
            raise ValueError(f"a breakpoint's ttl is one of {', '.join(TTL_SECONDS)}, got {self.ttl!r}")

    def range_for(self, prompt: Prompt) -> RetentionRange | None:
        """The range it adds to ``prompt`` (None: it has nowhere to go there)."""
        end = prompt.system_end if self.at == "system" else min(self.at, len(prompt.token_ids))
        if not end:
            return None
        return RetentionRange(0, end, BREAKPOINT_PRIORITY[self.ttl], TTL_SECONDS[self.ttl])

    def __str__(self) -> str:
        where = "after the system messages" if self.at == "system" else f"after token {self.at:,}"
        return f"a {self.ttl} breakpoint {where}"


@dataclass(frozen=True, slots=True)
class ExplainConfig:
    """``capacity_tokens`` turns on the replay through a real manager of that many tokens (whole blocks), whose
    KV cache groups are ``kv_cache_groups`` (the model's: a sliding-window layer keeps only its window).
    ``breakpoint`` (with a capacity) replays the log again with it added to every request.

    With a recurrent-state group (last in ``kv_cache_groups``) the replay is needed, and holds
    ``num_checkpoint_slots`` state checkpoints placed by ``checkpoint_policy`` beside ``num_state_slots`` working
    states (``engine.cache_layout`` sizes them from the memory as the engine does). ``max_chunk_tokens`` (None: a
    prompt in one step) prefills in the engine's chunks (its ``max_num_batched_tokens``)."""

    block_size: int = 16
    capacity_tokens: int | None = None
    eviction_policy: str = "lru"
    hash_algo: str = "sha256"
    window_tokens: int = 8
    kv_cache_groups: tuple[KVCacheGroupSpec, ...] = (FULL_ATTENTION,)
    breakpoint: WhatIfBreakpoint | None = None
    num_state_slots: int = 1
    num_checkpoint_slots: int = 0
    checkpoint_policy: CheckpointPolicy = DEFAULT_CHECKPOINT_POLICY
    max_chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_groups", check_groups(self.kv_cache_groups))
        if self.has_state and self.capacity_tokens is None:
            raise ValueError(
                "a model with recurrent layers hits where its state checkpoints lie, which needs a replay: give "
                "capacity_tokens (--capacity-tokens)"
            )
        if self.num_checkpoint_slots and not self.has_state:
            raise ValueError("num_checkpoint_slots needs a recurrent-state group in kv_cache_groups")
        if self.num_checkpoint_slots < 0 or self.num_state_slots <= 0:
            raise ValueError("num_checkpoint_slots must be >= 0 and num_state_slots positive")
        if self.max_chunk_tokens is not None and self.max_chunk_tokens <= 0:
            raise ValueError(f"max_chunk_tokens must be positive, got {self.max_chunk_tokens}")
        if self.breakpoint is not None and self.capacity_tokens is None:
            raise ValueError("a what-if breakpoint needs a replay: give capacity_tokens (--capacity-tokens)")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.capacity_tokens is not None and self.capacity_tokens < self.block_size:
            raise ValueError(f"capacity_tokens must hold at least one block of {self.block_size} tokens")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {self.eviction_policy!r}; choose from {list(EVICTION_POLICIES)}")
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"unknown hash algorithm {self.hash_algo!r}; choose from {list(HASH_ALGOS)}")
        if self.window_tokens <= 0:
            raise ValueError(f"window_tokens must be positive, got {self.window_tokens}")

    @property
    def has_state(self) -> bool:
        """Whether the model has recurrent layers (a recurrent-state group, last)."""
        return self.kv_cache_groups[-1].recurrent_state


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a prompt parts from the earlier prompt it shares most with (token ``index`` differs).

    For ``varying`` and ``inserted`` the differing tokens are ``[index, span_end)`` in this prompt and
    ``[index, other_span_end)`` in the other; after them the two agree again. ``this_context`` and
    ``other_context`` show that span in its surroundings (``…text before ⟦span⟧ text after…``; for
    ``differs``, the first tokens that differ); ``message_index`` is the chat message (from 0) holding it.
    """

    index: int
    kind: str
    shared_text: str
    this_text: str
    other_text: str
    span_end: int | None = None
    other_span_end: int | None = None
    this_context: str = ""
    other_context: str = ""
    message_index: int | None = None
    message_role: str | None = None


@dataclass(slots=True)
class RequestExplanation:
    index: int
    line: int
    prompt_tokens: int
    cache_salt: str | None
    lora_name: str | None
    match_line: int | None  # the earlier request of the same namespace sharing the longest prefix
    shared_tokens: int
    infinite_hit: int  # token-exact, unlimited cache
    block_hit: int  # whole blocks, unlimited cache
    missed: dict[str, int]
    divergence: Divergence | None = None
    capacity_hit: int | None = None
    live_cached: int | None = None  # what a running server holds now (explain --base-url)

    @property
    def reason(self) -> str:
        """The reason of the first missed token (every prompt misses at least its last token)."""
        return next(r for r in REASONS if self.missed[r])  # REASONS lie in this order in a prompt

    @property
    def core_reason(self) -> str:
        """The engine's reason of the first missed token (``first_miss_reason`` of ``/v1/cache/lookup``)."""
        return REFINES[self.reason]

    @property
    def checkpoint_would_save(self) -> int:
        """The what-if of a recurrent model: the prompt tokens a state checkpoint where this prompt parts from the
        cached path (at token ``capacity_hit + checkpoint_would_save``) would have saved it, its ``no_checkpoint``
        tokens: the attention groups held them."""
        return self.missed["no_checkpoint"]


@dataclass(slots=True)
class DivergenceSummary:
    """Where most prompts part from earlier ones: ``count`` of ``total`` divergences lie in tokens ``start``-``end``."""

    start: int
    end: int
    count: int
    total: int
    kind: str
    example_line: int
    other_line: int
    shared_text: str
    this_text: str
    other_text: str
    this_context: str
    other_context: str
    message_index: int | None
    message_role: str | None
    num_messages: int | None
    fix: str
    varying_span: tuple[int, int] | None = None  # in the example prompt
    varying_text: str | None = None
    prompts_rewritten: int = 0
    fixed_block_hit_rate: float | None = None  # the log's hit rate with the varying span moved to the end


@dataclass(slots=True)
class Explanation:
    config: ExplainConfig
    requests: list[RequestExplanation]
    prompt_tokens: int
    infinite_hit_rate: float
    block_hit_rate: float
    missed: dict[str, int]
    divergence: DivergenceSummary | None
    capacity_hit_rate: float | None = None
    live_hit_rate: float | None = None
    directed_requests: int = 0  # requests whose log line carries retention directives
    timed: bool = False  # the replay's TTLs followed the log's timestamps
    breakpoint_hit_rate: float | None = None  # the replay's hit rate with config.breakpoint on every request
    breakpoint_requests: int = 0  # requests it could be added to

    @property
    def checkpoint_would_save(self) -> int:
        """Prompt tokens state checkpoints where the prompts part would have saved, each request's alone summed
        (:attr:`RequestExplanation.checkpoint_would_save`); 0 for a model without recurrent layers."""
        return self.missed["no_checkpoint"]

    @property
    def checkpoint_hit_rate(self) -> float | None:
        """The replay's hit rate with those tokens hit too (None without a replay of a recurrent model)."""
        if self.capacity_hit_rate is None or not self.config.has_state:
            return None
        return self.capacity_hit_rate + self.checkpoint_would_save / self.prompt_tokens

    @property
    def missed_by_core_reason(self) -> dict[str, int]:
        """``missed`` summed by the engine's reasons: what its ``missed_tokens`` counters would show."""
        totals = dict.fromkeys(MISS_REASONS, 0)
        for reason, count in self.missed.items():
            totals[REFINES[reason]] += count
        return totals

    @property
    def alignment_loss(self) -> float:
        """Hit rate an infinite cache loses to whole-block reuse."""
        return self.infinite_hit_rate - self.block_hit_rate


def explain(
    prompts: Sequence[Prompt], config: ExplainConfig, decode: Decode, live_cached: Sequence[int] | None = None
) -> Explanation:
    """The whole report for ``prompts`` in log order; ``live_cached`` is a server's current hit per prompt."""
    if not prompts:
        raise ValueError("no prompts to explain")
    arrays = [np.asarray(p.token_ids, dtype=np.int64) for p in prompts]
    same = _longest_shared_prefixes(prompts, arrays, by_namespace=True)
    anywhere = _longest_shared_prefixes(prompts, arrays, by_namespace=False)
    replayed = _replay(prompts, config) if config.capacity_tokens is not None else None
    capacity_hits = None if replayed is None else [hit for hit, _, _ in replayed]
    block_size = config.block_size
    requests = []
    for i, prompt in enumerate(prompts):
        shared, match = same[i]
        num_tokens = len(prompt.token_ids)
        block_hit = _block_hit(shared, num_tokens, block_size)
        capacity_hit = None if capacity_hits is None else capacity_hits[i]
        explanation = RequestExplanation(
            index=i,
            line=prompt.line,
            prompt_tokens=num_tokens,
            cache_salt=prompt.cache_salt,
            lora_name=prompt.lora_name,
            match_line=None if match is None else prompts[match].line,
            shared_tokens=shared,
            infinite_hit=min(shared, num_tokens - 1),
            block_hit=block_hit,
            missed=_missed(num_tokens, block_size, block_hit, anywhere[i][0], *(replayed[i] if replayed else (None,))),
            capacity_hit=capacity_hit,
            live_cached=None if live_cached is None else live_cached[i],
        )
        if match is not None and shared < min(num_tokens, len(prompts[match].token_ids)):
            explanation.divergence = _divergence(prompt, prompts[match].token_ids, shared, config, decode)
        requests.append(explanation)
    total = sum(r.prompt_tokens for r in requests)
    breakpoint_hit_rate, breakpoint_requests = None, 0
    if config.breakpoint is not None:
        ranges = [config.breakpoint.range_for(p) for p in prompts]
        with_breakpoint = [
            p if r is None else replace(p, retention=(*p.retention, r)) for p, r in zip(prompts, ranges, strict=True)
        ]
        breakpoint_hit_rate = sum(hit for hit, _, _ in _replay(with_breakpoint, config)) / total
        breakpoint_requests = sum(r is not None for r in ranges)
    return Explanation(
        config=config,
        requests=requests,
        prompt_tokens=total,
        infinite_hit_rate=sum(r.infinite_hit for r in requests) / total,
        block_hit_rate=sum(r.block_hit for r in requests) / total,
        missed={reason: sum(r.missed[reason] for r in requests) for reason in REASONS},
        divergence=_summarize_divergences(prompts, requests, config, decode),
        capacity_hit_rate=None if capacity_hits is None else sum(capacity_hits) / total,
        live_hit_rate=None if live_cached is None else sum(live_cached) / total,
        directed_requests=sum(bool(p.retention) for p in prompts),
        timed=_timed(prompts),
        breakpoint_hit_rate=breakpoint_hit_rate,
        breakpoint_requests=breakpoint_requests,
    )


def block_hit_rate(prompts: Sequence[Prompt], block_size: int) -> float:
    """The token hit rate of an unlimited cache reusing whole blocks, prompts in order."""
    arrays = [np.asarray(p.token_ids, dtype=np.int64) for p in prompts]
    shared = _longest_shared_prefixes(prompts, arrays, by_namespace=True)
    hits = sum(_block_hit(n, len(p.token_ids), block_size) for (n, _), p in zip(shared, prompts, strict=True))
    return hits / sum(len(p.token_ids) for p in prompts)


def _block_hit(shared: int, num_tokens: int, block_size: int) -> int:
    return min(shared // block_size * block_size, hittable_tokens(num_tokens, block_size))


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _longest_shared_prefixes(
    prompts: Sequence[Prompt], arrays: Sequence[np.ndarray], by_namespace: bool
) -> list[tuple[int, int | None]]:
    """For each prompt, the longest prefix it shares with an earlier one, and that one's index (None: nothing).

    Earlier prompts are kept sorted; the longest common prefix with any of them is with one of the two
    neighbours of the new prompt in that order. Ties go to the most recent request.
    """
    sorted_keys: dict[object, list[tuple[tuple[int, ...], int]]] = {}
    out: list[tuple[int, int | None]] = []
    for i, prompt in enumerate(prompts):
        keys = sorted_keys.setdefault(prompt.namespace if by_namespace else None, [])
        key = (tuple(prompt.token_ids), i)
        position = bisect.bisect_left(keys, key)
        best, match = 0, None
        for _, j in keys[max(0, position - 1) : position + 1]:
            shared = _common_prefix(arrays[i], arrays[j])
            if shared > best or (shared == best and shared > 0 and j > match):
                best, match = shared, j
        out.append((best, match))
        keys.insert(position, key)
    return out


def _missed(
    num_tokens: int,
    block_size: int,
    block_hit: int,
    shared_anywhere: int,
    capacity_hit: int | None,
    no_checkpoint: int = 0,
    eviction_cause: str | None = None,
) -> dict[str, int]:
    """The request's missed tokens by reason (see the module docstring), split as the engine splits them: the
    attention groups' blocks past the hit that a state checkpoint was missing for (``no_checkpoint`` of them,
    from the replay), the hittable tokens after those by the first missing block, then the partial block.
    ``eviction_cause`` is the replay's reason for them (plain ``evicted`` when the engine's record no longer
    held the hash)."""
    missed = dict.fromkeys(REASONS, 0)
    missed["no_checkpoint"] = no_checkpoint
    hittable_end = hittable_tokens(num_tokens, block_size)
    held_end = None if capacity_hit is None else capacity_hit + no_checkpoint  # what the attention groups held
    if held_end is not None and held_end < block_hit:  # the first missing block was cached, then evicted
        cause = eviction_cause or EVICTED
        missed[cause] = block_hit - held_end
        missed[f"after_{cause}"] = hittable_end - block_hit
    elif block_hit < hittable_end:
        other_namespace_has_next_block = shared_anywhere >= block_hit + block_size
        missed["different_salt" if other_namespace_has_next_block else "never_seen"] = hittable_end - block_hit
    missed["shorter_than_block" if hittable_end == 0 else "tail"] = num_tokens - max(block_hit, hittable_end)
    return missed


class _LogClock:
    """The replay's clock for TTLs: the current request's timestamp, in seconds (never back)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _timed(prompts: Sequence[Prompt]) -> bool:
    """Whether the replay follows the log's timestamps: only when every request has one."""
    return all(p.timestamp is not None for p in prompts)


def _replay(prompts: Sequence[Prompt], config: ExplainConfig) -> list[tuple[int, int, str | None]]:
    """Each prompt's hit in a real manager of ``capacity_tokens``, one request at a time, in log order, with its
    retention directives and checkpoint hints, the tokens the manager counted as ``no_checkpoint`` (its attention
    groups held them, a recurrent model's state checkpoint was missing) and the eviction cause it counted its
    hittable miss under (None: not one).

    Raises ValueError for a prompt larger than the whole cache, numbered by its log line.
    """
    clock = _LogClock()
    manager = KVCacheManager(
        num_blocks=config.capacity_tokens // config.block_size,
        block_size=config.block_size,
        hash_algo=config.hash_algo,
        eviction_policy=config.eviction_policy,
        groups=config.kv_cache_groups,
        clock=clock,
        num_state_slots=config.num_state_slots if config.has_state else 0,
        num_checkpoint_slots=config.num_checkpoint_slots,
        checkpoint_policy=config.checkpoint_policy,
    )
    # A request is freed when the next one arrives, as an engine serving the log one request at a time frees it.
    cache = HeldCache(manager, in_flight=1, max_chunk_tokens=config.max_chunk_tokens)
    timed = _timed(prompts)
    missed = manager.stats.missed_tokens
    out = []
    for i, prompt in enumerate(prompts):
        if timed:
            clock.now = max(clock.now, prompt.timestamp)
        cache.advance(float(i))
        request = Request(
            str(i),
            prompt.token_ids,
            cache_salt=prompt.cache_salt,
            lora_name=prompt.lora_name,
            retention=prompt.retention,
            checkpoint_hints=prompt.checkpoint_hints,
        )
        before = [missed[cause] for cause in EVICTION_CAUSES]
        no_checkpoint = missed["no_checkpoint"]
        hit = cache.admit(prompt.line, request, 0)
        cause = next((c for c, n in zip(EVICTION_CAUSES, before, strict=True) if missed[c] > n), None)
        out.append((hit, missed["no_checkpoint"] - no_checkpoint, cause))
    cache.drain()
    return out


def _resync(a: Sequence[int], b: Sequence[int], start: int) -> tuple[int, int] | None:
    """The first offsets (x, y) after ``start`` where ``a`` and ``b`` agree again for SYNC_TOKENS tokens."""
    grams: dict[tuple[int, ...], int] = {}
    for y in range(min(MAX_SPAN_TOKENS, len(b) - start - SYNC_TOKENS) + 1):
        grams.setdefault(tuple(b[start + y : start + y + SYNC_TOKENS]), y)
    for x in range(min(MAX_SPAN_TOKENS, len(a) - start - SYNC_TOKENS) + 1):
        y = grams.get(tuple(a[start + x : start + x + SYNC_TOKENS]))
        if y is not None:
            return x, y
    return None


def _divergence(prompt: Prompt, other: list[int], index: int, config: ExplainConfig, decode: Decode) -> Divergence:
    tokens = prompt.token_ids
    window = config.window_tokens
    offsets = _resync(tokens, other, index)
    kind = "differs" if offsets is None else "varying" if min(offsets) > 0 else "inserted"
    span_end = None if offsets is None else index + offsets[0]
    other_span_end = None if offsets is None else index + offsets[1]
    before = decode(tokens[max(0, index - window) : index])
    span = decode(tokens[index : span_end if span_end is not None else index + window])
    message_index = locate_message(prompt.messages, before, span)
    return Divergence(
        index=index,
        kind=kind,
        shared_text=_clip(before, from_end=True),
        this_text=_clip(decode(tokens[index : index + window])),
        other_text=_clip(decode(other[index : index + window])),
        span_end=span_end,
        other_span_end=other_span_end,
        this_context=_context(tokens, index, span_end, window, decode),
        other_context=_context(other, index, other_span_end, window, decode),
        message_index=message_index,
        message_role=None if message_index is None else prompt.messages[message_index].get("role"),
    )


def _context(tokens: Sequence[int], start: int, end: int | None, window: int, decode: Decode) -> str:
    """``…before ⟦tokens[start:end]⟧ after…`` with ``window`` tokens each side; without an ``end`` (the prompts do
    not agree again) the first ``window`` tokens from ``start`` are marked."""
    stop = end if end is not None else min(len(tokens), start + window)
    after_stop = min(len(tokens), stop + window) if end is not None else stop
    text = "…" if start > window else ""
    text += _escape(decode(tokens[max(0, start - window) : start]))
    text += f"⟦{_escape(decode(tokens[start:stop]))}⟧{_escape(decode(tokens[stop:after_stop]))}"
    return text + ("…" if after_stop < len(tokens) else "")


def locate_message(messages: Sequence[dict[str, str]] | None, before: str, span: str) -> int | None:
    """The message whose content holds ``span`` right after the end of ``before`` (as much of it as a message
    holds: the start of the window may be template markup); None for a prompt without messages, or a span in the
    template's own text."""
    if not messages:
        return None
    contents = [m.get("content") or "" for m in messages]
    for cut in range(len(before) + 1):  # the longest stretch of text before the span first
        needle = before[cut:] + span
        if not needle:
            break
        for i, content in enumerate(contents):
            if needle in content:
                return i
    return None


def _escape(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t")


def _clip(text: str, from_end: bool = False) -> str:
    text = _escape(text)
    if len(text) <= TEXT_CHARS:
        return text
    return "…" + text[-TEXT_CHARS:] if from_end else text[:TEXT_CHARS] + "…"


def _summarize_divergences(
    prompts: Sequence[Prompt], requests: Sequence[RequestExplanation], config: ExplainConfig, decode: Decode
) -> DivergenceSummary | None:
    """The window of CLUSTER_TOKENS tokens where most divergences lie, what kind they are, and the fix."""
    parted = sorted((r for r in requests if r.divergence is not None), key=lambda r: r.divergence.index)
    if not parted:
        return None
    best_start, best_count, end = 0, 0, 0
    for start in range(len(parted)):
        while end < len(parted) and parted[end].divergence.index < parted[start].divergence.index + CLUSTER_TOKENS:
            end += 1
        if end - start > best_count:
            best_start, best_count = start, end - start
    cluster = parted[best_start : best_start + best_count]
    kind = Counter(r.divergence.kind for r in cluster).most_common(1)[0][0]
    groups: dict[tuple[int, ...], list[RequestExplanation]] = {}  # by the tokens before the split, log order
    for r in sorted(cluster, key=lambda r: r.index):
        if r.divergence.kind == kind:
            groups.setdefault(tuple(prompts[r.index].token_ids[: r.divergence.index]), []).append(r)
    fix = _fix_varying_spans(prompts, groups, config.block_size) if kind == "varying" else None
    example = fix.example if fix is not None else max(groups.values(), key=len)[0]
    summary = DivergenceSummary(
        start=cluster[0].divergence.index,
        end=cluster[-1].divergence.index,
        count=len(cluster),
        total=len(parted),
        kind=kind,
        example_line=example.line,
        other_line=example.match_line,
        shared_text=example.divergence.shared_text,
        this_text=example.divergence.this_text,
        other_text=example.divergence.other_text,
        this_context=example.divergence.this_context,
        other_context=example.divergence.other_context,
        message_index=example.divergence.message_index,
        message_role=example.divergence.message_role,
        num_messages=None if prompts[example.index].messages is None else len(prompts[example.index].messages),
        fix=_FIXES[kind],
    )
    if fix is not None:
        summary.varying_span = fix.span
        summary.varying_text = _clip(decode(prompts[example.index].token_ids[fix.span[0] : fix.span[1]]))
        summary.prompts_rewritten = fix.prompts_rewritten
        summary.fixed_block_hit_rate = fix.block_hit_rate
    return summary


_FIXES = {
    "varying": "move what changes after what stays: put the varying part at the end of the prompt (or into the "
    "last user message), so the stable text before and after it forms one shared prefix",
    "inserted": "keep the sections in one fixed order, and put sections only some prompts have after those "
    "every prompt has",
    "differs": "nothing to move: the prompts share everything before this point and differ after it (their own "
    "content), so that is where caching is expected to stop",
}


@dataclass(frozen=True, slots=True)
class _VaryingFix:
    """The log with its varying spans moved to the end: its block hit rate, and the span that moved most often."""

    block_hit_rate: float
    prompts_rewritten: int
    example: RequestExplanation
    span: tuple[int, int]


def _fix_varying_spans(
    prompts: Sequence[Prompt], groups: dict[tuple[int, ...], list[RequestExplanation]], block_size: int
) -> _VaryingFix:
    """Move each varying span to the end of every prompt that has it, and recompute the block hit rate.

    Prompts parting at the same point after the same head (the tokens before it) form a group. Its span
    starts there and ends where the group's first prompt agrees again with the prompts sharing its head
    (the union of the differing spans, so a field whose leading characters happen to match is still
    moved whole). Every prompt with that head in which the span's continuation (the next SYNC_TOKENS
    tokens) follows soon after has the span moved to its end. Shorter heads go first; a prompt is
    rewritten at most once; prompts of no group stay as they are.
    """
    by_head_at: dict[int, dict[tuple[int, ...], list[int]]] = {}
    moved: dict[int, list[int]] = {}
    most: tuple[int, RequestExplanation, tuple[int, int]] | None = None  # (prompts moved, example, span)
    for head, group in sorted(groups.items(), key=lambda item: len(item[0])):
        start = len(head)
        if start not in by_head_at:
            by_head_at[start] = _prompts_by_head(prompts, start)
        sharing = by_head_at[start][head]
        tokens = prompts[group[0].index].token_ids
        end = group[0].divergence.span_end
        for i in sharing[:MAX_RESYNC_PROMPTS]:
            offsets = _resync(tokens, prompts[i].token_ids, start)
            if offsets is not None:
                end = max(end, start + offsets[0])
        anchor = tokens[end : end + SYNC_TOKENS]
        num_moved = len(moved)
        for i in sharing:
            if i not in moved:
                rewritten = _move_to_end(prompts[i].token_ids, start, anchor)
                if rewritten is not None:
                    moved[i] = rewritten
        if most is None or len(moved) - num_moved > most[0]:
            most = (len(moved) - num_moved, group[0], (start, end))
    fixed = [replace(p, token_ids=moved[i]) if i in moved else p for i, p in enumerate(prompts)]
    return _VaryingFix(block_hit_rate(fixed, block_size), len(moved), most[1], most[2])


def _prompts_by_head(prompts: Sequence[Prompt], length: int) -> dict[tuple[int, ...], list[int]]:
    heads: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        heads.setdefault(tuple(prompt.token_ids[:length]), []).append(i)
    return heads


def _move_to_end(tokens: list[int], start: int, anchor: list[int]) -> list[int] | None:
    """``tokens`` with the span from ``start`` to the next occurrence of ``anchor`` moved to the end."""
    if len(anchor) < SYNC_TOKENS:
        return None
    for position in range(start + 1, min(start + MAX_SPAN_TOKENS, len(tokens) - SYNC_TOKENS) + 1):
        if tokens[position : position + SYNC_TOKENS] == anchor:
            return tokens[:start] + tokens[position:] + tokens[start:position]
    return None
