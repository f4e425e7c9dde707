"""A request as the engine core sees it: the cache manager's request plus sampling and scheduling state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from prefixcache.core import Request
from prefixcache.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True, eq=False)
class EngineRequest(Request):
    """``num_cached_tokens`` is the prefix-cache hit at first admission, as reported to the user (what the
    scheduler's waiting queue knows of a request, its rank and aging, stays in the queue)."""

    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    num_cached_tokens: int | None = field(default=None, init=False)
    num_preemptions: int = field(default=0, init=False)
    prompt_logprobs: list[dict[int, float] | None] | None = field(default=None, init=False)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)
