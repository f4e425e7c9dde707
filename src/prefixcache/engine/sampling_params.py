"""How to pick the next tokens and when to stop: named and defaulted like vLLM's, so users can switch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this a temperature is greedy: dividing logits by it would overflow float32 (1e-38 turns a logit of
# 10 into inf and the softmax into NaN), and the distribution is a one-hot at the argmax long before. vLLM's
# sampler uses the same epsilon.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # top log-probabilities per position, as OpenAI's top_logprobs and vLLM's default max_logprobs
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 512  # a stream holds back this many characters, and each is searched for every step
MAX_STOP_TOKEN_IDS = 1024
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes (negatives wrap modulo 2**64)
MAX_TOP_K = 2**31 - 1  # any top_k from the vocabulary size up keeps every token; bounded so it fits a message
MAX_TRUNCATE_PROMPT_TOKENS = 2**31 - 1  # beyond any context; bounded so it fits a message
MAX_PENALTY = 2.0  # OpenAI's range for frequency and presence penalties is [-2, 2]


class InvalidParameter(ValueError):
    """A sampling value out of range; ``param`` names the field, so a server can point at it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling and stopping for one request; validated on construction so bad input fails early.

    ``temperature=0`` is greedy, and so is any temperature below ``GREEDY_TEMPERATURE`` (it is stored as 0).
    ``top_k=0`` and ``top_p=1`` turn those filters off. ``seed`` makes one request's sampling reproducible
    whatever else is in the batch. Penalties follow vLLM: ``presence_penalty`` and ``frequency_penalty``
    (OpenAI's, in [-2, 2]) are subtracted from the logits of tokens already generated, once and per
    occurrence; ``repetition_penalty`` (> 0, 1 is off) divides positive and multiplies negative logits of
    tokens seen in the prompt or the output. ``logprobs=k`` returns, for every generated token, its
    log-probability and the top-k under the model's raw distribution (before penalties, temperature and
    filters). ``prompt_logprobs=k`` does the same at every prompt position; it forces the whole prompt to be
    computed, so such a request does not read the prefix cache (it still fills it for others).

    vLLM's extensions, with its meaning: ``min_p`` (in [0, 1], 0 is off) drops, after temperature and before
    top-k/top-p, every token less likely than ``min_p`` times the most likely one; ``min_tokens`` (at most
    ``max_tokens``) bans EOS and the stop token ids until that many tokens are generated, and no stop string
    ends the request within them; ``skip_special_tokens`` leaves special tokens out of the text, and with it
    off, ``spaces_between_special_tokens=False`` joins a special token to a special one before it with no
    space; ``truncate_prompt_tokens=k`` keeps the prompt's last k tokens (-1: as many as the context holds
    beside ``max_tokens``).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check_int("max_tokens", self.max_tokens, 1)
        _check_number("temperature", self.temperature, 0.0)
        if self.temperature < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        _check_number("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0:
            raise InvalidParameter("top_p", "top_p must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, 0, MAX_TOP_K)
        if self.seed is not None:
            _check_int("seed", self.seed, MIN_SEED, MAX_SEED)
        _check_number("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_number("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_number("repetition_penalty", self.repetition_penalty, 0.0)
        if self.repetition_penalty == 0:
            raise InvalidParameter("repetition_penalty", "repetition_penalty must be > 0, got 0")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParameter("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidParameter("stop", f"stop strings must be 1 to {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParameter("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidParameter("stop_token_ids", "stop_token_ids must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        for name in ("skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameter(name, f"{name} must be true or false, got {getattr(self, name)!r}")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and truncate != -1:
            _check_int("truncate_prompt_tokens", truncate, 1, MAX_TRUNCATE_PROMPT_TOKENS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def banned_token_ids(self, num_output_tokens: int, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The tokens that may not be sampled next: EOS and the stop token ids while fewer than ``min_tokens``
        are generated (vLLM bans EOS then even with ``ignore_eos``)."""
        if num_output_tokens >= self.min_tokens:
            return ()
        return tuple(dict.fromkeys((*eos_token_ids, *self.stop_token_ids)))

    @property
    def stop_holdback(self) -> int:
        """Characters a stream holds back because they could still become the start of a stop string."""
        return max((len(s) for s in self.stop), default=1) - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not _is_int(value) or value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidParameter(name, f"{name} must be an integer {bounds}, got {value!r}")


def _check_number(name: str, value: object, low: float, high: float | None = None) -> None:
    """A finite number in [low, high]: NaN and infinities are refused, they poison a whole batch's softmax."""
    finite = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not finite or value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidParameter(name, f"{name} must be a finite number {bounds}, got {value!r}")
