"""How to pick the next tokens and when to stop: named and defaulted like vLLM's, so users can switch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling and stopping for one request; validated on construction so bad input fails early.

    ``temperature=0`` is greedy. ``top_k=0`` and ``top_p=1`` turn those filters off. ``seed`` makes
    one request's sampling reproducible whatever else is in the batch. ``prompt_logprobs=k`` returns
    the top-k log-probabilities at every prompt position; it forces the whole prompt to be computed,
    so such a request does not read the prefix cache (it still fills it for others).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def stop_holdback(self) -> int:
        """Characters a stream holds back because they could still become the start of a stop string."""
        return max((len(s) for s in self.stop), default=1) - 1
