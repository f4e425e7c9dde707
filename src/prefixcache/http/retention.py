"""Retention directives as the APIs spell them, and what each becomes: ``RetentionRange`` values on the core request.

Three shapes, on every generation endpoint that has the inputs for them:

- ``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` (Anthropic's) on a tool, a message or a content
  part: a breakpoint, "keep the prefix up to the end of this part". At most ``MAX_BREAKPOINTS`` a request. The
  chat template decides where that end is (``engine/chat_breakpoints.py``); the prefix is kept at the priority of
  its TTL (``BREAKPOINT_PRIORITY``: 1h above 5m, both above the default 35) for that TTL after its last use.
- ``retention: [{"token_start", "token_end", "priority", "duration_ms"}]`` (TensorRT-LLM's
  ``TokenRangeRetentionConfig``, the shape of vLLM's RFC #37003): token ranges of the prompt with a priority 0..100
  and a TTL in milliseconds (null: as long as the priority keeps them).
- ``prompt_cache_retention: "in_memory" | "24h"`` (OpenAI's): ``in_memory`` is what every request gets anyway;
  ``24h`` keeps the whole request at ``PERSISTENT_PRIORITY`` for 24 hours, the TTL the persistent tier (disk,
  Redis) keeps it with.

Breakpoints overlap by nature (each covers everything before it); they become disjoint ranges, each at the
strongest directive that covers it, so the result does not depend on how the cache combines overlapping ranges.
The operator's bounds (the largest TTL, the retained share, a tenant's quota) are the engine's to apply; what it
clamped comes back on the output and the response reports it (``usage.retention_clamped``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, StrictInt, field_validator, model_validator

from prefixcache.core.retention import MAX_PRIORITY, MIN_PRIORITY, RetentionRange
from prefixcache.engine.chat_breakpoints import Breakpoint

MAX_BREAKPOINTS = 4  # Anthropic's limit on cache_control blocks in one request
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
# A breakpoint's priority by its TTL: above the default (35), and a longer-lived prefix above a shorter one, so
# under pressure 5-minute prefixes go before hour-long ones and both before undirected blocks.
BREAKPOINT_PRIORITY = {"5m": 60, "1h": 80}
PERSISTENT_PRIORITY = 90  # prompt_cache_retention "24h"
PERSISTENT_TTL_S = 86400.0


class _Directive(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Directive):
    """Anthropic's ``cache_control``; ``ttl`` defaults to 5 minutes, as there."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"

    @property
    def ttl_s(self) -> float:
        return TTL_SECONDS[self.ttl]

    @property
    def priority(self) -> int:
        return BREAKPOINT_PRIORITY[self.ttl]


class TokenRangeRetention(_Directive):
    """One ``retention`` entry: prompt tokens ``token_start`` .. ``token_end`` (exclusive; null: to the end of the
    request), kept at ``priority`` for ``duration_ms`` after their last use (null: no TTL)."""

    token_start: StrictInt
    token_end: StrictInt | None = None
    priority: StrictInt
    duration_ms: StrictInt | None = None

    @field_validator("token_start")
    @classmethod
    def _start(cls, start: int) -> int:
        if start < 0:
            raise ValueError("token_start must be >= 0")
        return start

    @field_validator("priority")
    @classmethod
    def _priority(cls, priority: int) -> int:
        if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}]")
        return priority

    @field_validator("duration_ms")
    @classmethod
    def _duration(cls, duration: int | None) -> int | None:
        if duration is not None and duration <= 0:
            raise ValueError("duration_ms must be a positive number of milliseconds, or null for no TTL")
        return duration

    @model_validator(mode="after")
    def _ordered(self) -> TokenRangeRetention:
        if self.token_end is not None and self.token_end <= self.token_start:
            raise ValueError("token_end must be greater than token_start, or null for the end of the request")
        return self

    def range(self) -> RetentionRange:
        ttl_s = None if self.duration_ms is None else self.duration_ms / 1000
        return RetentionRange(self.token_start, self.token_end, self.priority, ttl_s)


PromptCacheRetention = Literal["in_memory", "24h"]


def check_breakpoint_count(count: int) -> None:
    """ValueError past ``MAX_BREAKPOINTS``; body validators call it, so the 400 comes before any template work."""
    if count > MAX_BREAKPOINTS:
        raise ValueError(f"at most {MAX_BREAKPOINTS} cache_control breakpoints are allowed in a request, got {count}")


class MarkedText(Protocol):
    """A text part or block: its text, and its breakpoint if it has one."""

    text: str
    cache_control: CacheControl | None


def part_breakpoints(parts: Sequence[MarkedText], index: int) -> list[tuple[Breakpoint, CacheControl]]:
    """A breakpoint at the end of each marked part of message ``index``, counted in the one content string the
    parts are joined into for the chat template."""
    marks = []
    end = 0
    for part in parts:
        end += len(part.text)
        if part.cache_control is not None:
            marks.append((Breakpoint("content", index, end), part.cache_control))
    return marks


def breakpoint_ranges(positions: Sequence[int], controls: Sequence[CacheControl]) -> list[RetentionRange]:
    """Breakpoints (token position, its cache_control) as disjoint ranges: tokens before a position are covered
    by its breakpoint and every later one, and get the strongest of them (highest priority, then longest TTL).
    A breakpoint at position 0 covers nothing."""
    points = sorted(zip(positions, controls, strict=True), key=lambda p: p[0])
    ranges: list[RetentionRange] = []
    start = 0
    for i, (position, _) in enumerate(points):
        if position <= start:
            continue
        strongest = max((c for _, c in points[i:]), key=lambda c: (c.priority, c.ttl_s))
        ranges.append(RetentionRange(start, position, strongest.priority, strongest.ttl_s))
        start = position
    return ranges


def request_ranges(
    retention: Sequence[TokenRangeRetention] | None, prompt_cache_retention: PromptCacheRetention | None
) -> list[RetentionRange]:
    """The ranges a request's ``retention`` and ``prompt_cache_retention`` ask for (the same for every prompt)."""
    ranges = [entry.range() for entry in retention or ()]
    if prompt_cache_retention == "24h":
        ranges.append(RetentionRange(0, None, PERSISTENT_PRIORITY, PERSISTENT_TTL_S))
    return ranges


def written_by_ttl(by_ttl: Mapping[float | None, int]) -> tuple[int, int]:
    """Prompt tokens written into retained blocks (``num_retained_written_tokens_by_ttl``: by the TTL in seconds
    their blocks are kept for) split as Anthropic's ``cache_creation`` splits them: kept at most 5 minutes, and
    kept longer (a 1h breakpoint, one cut by the operator's largest TTL to more than 5 minutes, a longer
    ``retention`` or ``24h``, or no TTL: as long as the priority keeps them). The one split every API shape reports."""
    longer = sum(n for ttl, n in by_ttl.items() if ttl is None or ttl > TTL_SECONDS["5m"])
    return sum(by_ttl.values()) - longer, longer


def range_json(directive: RetentionRange) -> dict[str, int | None]:
    """A range in the ``retention`` field's shape (what the render endpoints show a request would run with)."""
    duration_ms = None if directive.ttl_s is None else round(directive.ttl_s * 1000)
    return {
        "token_start": directive.start,
        "token_end": directive.end,
        "priority": directive.priority,
        "duration_ms": duration_ms,
    }
