"""A request as the engine sees it: the core request plus sampling, detokenized text and timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from prefixcache.core import Request
from prefixcache.engine.detokenizer import IncrementalDetokenizer
from prefixcache.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True, eq=False)
class EngineRequest(Request):
    """``num_cached_tokens`` is the prefix-cache hit at first admission, as reported to the user."""

    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    num_cached_tokens: int | None = field(default=None, init=False)
    num_preemptions: int = field(default=0, init=False)
    first_token_time: float | None = field(default=None, init=False)
    last_token_time: float | None = field(default=None, init=False)
    detokenizer: IncrementalDetokenizer | None = None
    text: str = field(default="", init=False)
    num_emitted_chars: int = field(default=0, init=False)
    finish_reason: str | None = field(default=None, init=False)
    stop_reason: int | str | None = field(default=None, init=False)
    prompt_logprobs: list[dict[int, float] | None] | None = field(default=None, init=False)

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)
