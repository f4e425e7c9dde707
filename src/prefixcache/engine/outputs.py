"""What ``generate`` returns and what the engine emits per step: shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS, stop token or string), "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # per token: the sampled token's, then the top-k
    error: str | None = None  # why an "abort" that the engine decided happened (the request failed alone)


@dataclass(slots=True)
class RequestOutput:
    """One request's state after a step. ``num_cached_tokens``: prompt tokens served by the prefix cache.

    With retention directives: ``num_retained_written_tokens`` / ``num_retained_read_tokens`` are the prompt tokens
    written into / read from retained blocks (the written ones by the TTL their blocks are kept for in
    ``num_retained_written_tokens_by_ttl``), and ``retention_clamped`` says why a directive was clamped."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    prompt_logprobs: list[dict[int, float] | None] | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    num_retained_written_tokens: int = 0
    num_retained_read_tokens: int = 0
    retention_clamped: str | None = None
    num_retained_written_tokens_by_ttl: dict[float, int] = field(default_factory=dict)
