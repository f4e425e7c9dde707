"""The messages between the API side (input and output processing) and the engine core.

They are msgspec structs encoded as msgpack arrays: the same objects are passed directly when the core
runs in the caller's process (the offline ``LLM``) and as bytes over ZeroMQ when it runs in its own
process (``prefixcache serve``). The core only sees token ids; text lives on the API side.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from prefixcache.core.kv_cache_groups import FULL_ATTENTION, KVCacheGroupSpec
from prefixcache.core.retention import RetentionRange
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.offload.store import TierStats

FinishReason = Literal["stop", "length", "abort"]


class EngineCoreRequest(msgspec.Struct, array_like=True, tag=True, frozen=True):
    """A validated request in token ids, as the input processor hands it to the core.

    ``retention`` holds the request's retention directives (token ranges with a priority and a TTL, from any of
    the API shapes); ``tenant`` is the API key's tenant (None without API keys), whose quota bounds them.
    ``checkpoint_hints`` are prompt positions where a later request is likely to part from this one (a chat's
    message ends), where a model with recurrent layers checkpoints its state.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    lora_name: str | None = None
    retention: tuple[RetentionRange, ...] = ()
    tenant: str | None = None
    checkpoint_hints: tuple[int, ...] = ()


class AbortRequests(msgspec.Struct, array_like=True, tag=True, frozen=True):
    """Stop these requests and free their blocks; ids that are not in flight are ignored."""

    request_ids: list[str]


class UtilityCall(msgspec.Struct, array_like=True, tag=True, frozen=True):
    """Call ``EngineCore.<method>(*args)`` between steps; answered by a ``UtilityResult`` with ``call_id``."""

    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, array_like=True, tag=True, frozen=True):
    """Finish the current step, then exit cleanly."""


class EngineStats(msgspec.Struct, array_like=True, tag=True, frozen=True):
    """The core's counters and load after a step.

    ``prefix_cache_hits`` counts every prompt token whose K/V was not computed (shared blocks and sub-block
    copies, of which ``prefix_cache_copied_tokens`` were copies); ``prefix_cache_hit_rate`` is hits over
    queries, and ``rolling_hit_rate`` the same over the last finished requests. The same definition is used
    by ``/metrics`` and the benchmarks. A request admitted again after a preemption is not counted there but
    in ``prefix_cache_preempted_queries`` and ``prefix_cache_preempted_hits``: those hits are its own blocks
    read back, not sharing. A model with recurrent layers also counts its state checkpoints: saved, hit (an
    admission restored one) and evicted by the budget.

    Retention: ``prefix_cache_retained_read_tokens`` / ``_written_tokens`` are prompt tokens read from / written
    into retained blocks; ``kv_cache_block_hits`` / ``_evictions`` / ``_expirations`` count blocks by priority
    class (``prefixcache.core.block_pool.PRIORITY_CLASSES``) and ``retained_blocks_by_tenant`` holds the blocks
    above the default priority now, by tenant ("" without one).
    """

    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_copied_tokens: int
    prefix_cache_missed_tokens: dict[str, int]  # prompt tokens computed, by reason (prefixcache.core.miss)
    prefix_cache_hit_rate: float
    rolling_hit_rate: float
    num_requests: int
    num_preemptions: int
    kv_cache_usage: float
    num_running: int
    num_waiting: int
    num_blocks: int
    block_size: int
    kv_offload: list[TierStats] = []
    kv_events_dropped: int = 0
    # Admissions after a preemption, counted apart: they re-read the request's own blocks, not shared ones.
    prefix_cache_preempted_queries: int = 0
    prefix_cache_preempted_hits: int = 0
    prefix_cache_retained_read_tokens: int = 0
    prefix_cache_retained_written_tokens: int = 0
    kv_cache_block_hits: dict[str, int] = {}
    kv_cache_block_evictions: dict[str, int] = {}
    kv_cache_block_expirations: dict[str, int] = {}
    retained_blocks_by_tenant: dict[str, int] = {}
    state_checkpoints_saved: int = 0
    state_checkpoint_hits: int = 0
    state_checkpoints_evicted: int = 0


class EngineCoreOutput(msgspec.Struct, array_like=True, frozen=True):
    """One request's progress in one step: only the tokens new in this step.

    ``finish_reason`` is set on the last output: ``stop`` (EOS or a stop token id, which is then
    ``stop_reason``), ``length`` (max_tokens or the context length) or ``abort``; an ``abort`` that the core
    decided (the request failed alone, e.g. its sampling raised) carries ``error``. ``logprobs`` has one
    ``{token id: log-probability}`` per new token (the sampled token first, then the top-k) when the request
    asked for them. ``prompt_logprobs`` comes once, with the first token.

    On the output that carries ``num_cached_tokens`` (every one, as it is fixed at first admission):
    ``num_retained_written_tokens`` / ``num_retained_read_tokens`` are the prompt tokens this request wrote into /
    read from blocks that it or another request marked retained (priority above the default), Anthropic's
    ``cache_creation_input_tokens`` / ``cache_read_input_tokens``, the written ones also by the TTL (seconds) their
    blocks are kept for in ``num_retained_written_tokens_by_ttl`` (Anthropic's ``cache_creation`` split by TTL);
    ``retention_clamped`` names the bounds its directives ran into, comma-separated, for the response:
    ``max_retention_ttl_s`` (a TTL was cut to the largest), ``max_tenant_retained_fraction`` (the tenant's quota) and
    ``max_retained_fraction`` (the share) demoted its tenant's / anyone's least recently marked retained blocks.
    """

    request_id: str
    new_token_ids: list[int]
    num_cached_tokens: int
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    num_retained_written_tokens: int = 0
    num_retained_read_tokens: int = 0
    retention_clamped: str | None = None
    num_retained_written_tokens_by_ttl: dict[float, int] = {}


class EngineCoreOutputs(msgspec.Struct, array_like=True, tag=True, frozen=True):
    """A step's outputs with the stats after it; ``timestamp`` is ``time.monotonic()`` when the step ended."""

    outputs: list[EngineCoreOutput]
    timestamp: float
    stats: EngineStats


class UtilityResult(msgspec.Struct, array_like=True, tag=True, frozen=True):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineCoreFailure(msgspec.Struct, array_like=True, tag=True, frozen=True):
    """The core cannot go on (startup failed, or a step raised); it exits after sending this."""

    message: str


class EngineInfo(msgspec.Struct, array_like=True, tag=True, frozen=True):
    """The startup handshake: what the API side needs to validate requests and describe the engine.

    ``architecture``, ``dtype`` (the weights' and KV cache's, as resolved by the core), ``device`` and
    ``kv_cache_bytes`` (what the KV blocks take) describe the engine in the start-up log and metadata paths.
    ``kv_cache_groups`` are the cache's groups in the core's order, which a router needs to predict its hits.
    A model with recurrent layers adds its state budget (``num_state_slots`` working states,
    ``num_checkpoint_slots`` checkpoints, sparse ones every ``sparse_every_blocks`` blocks), which ``explain``
    needs to replay the server's checkpoints.
    """

    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    hash_algo: str
    hash_seed: str
    enable_prefix_caching: bool
    # The longest request (prompt plus output) the KV cache can hold.
    kv_capacity_tokens: int
    architecture: str = ""
    dtype: str = ""
    device: str = ""
    kv_cache_bytes: int = 0
    kv_cache_groups: tuple[KVCacheGroupSpec, ...] = (FULL_ATTENTION,)
    num_state_slots: int = 0
    num_checkpoint_slots: int = 0
    sparse_every_blocks: int = 0

    @property
    def max_request_tokens(self) -> int:
        """The longest request (prompt plus output) this engine takes: its context, or less where the KV cache
        holds less (a small ``--kv-cache-memory``); what a request without ``max_tokens`` may grow to."""
        return min(self.max_model_len, self.kv_capacity_tokens)


CoreInput = EngineCoreRequest | AbortRequests | UtilityCall | Shutdown
CoreOutput = EngineCoreOutputs | UtilityResult | EngineCoreFailure | EngineInfo

encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(CoreInput)
output_decoder = msgspec.msgpack.Decoder(CoreOutput)
