"""Retention directives: which of a request's tokens it asks the cache to keep, at what priority, for how long.

The API side turns every way a user can say it (Anthropic's ``cache_control`` breakpoints, a ``retention`` list of
token ranges, OpenAI's ``prompt_cache_retention``) into ``RetentionRange`` values on the core request; the cache
manager gives each full block the priority and expiry of the ranges that cover it, and the block pool evicts free
blocks expired first, then by lowest priority, least recently used within a priority (TensorRT-LLM's semantics:
when a TTL ends the block falls back to the default priority).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MIN_PRIORITY = 0
MAX_PRIORITY = 100
# Every block without a directive has this priority (TensorRT-LLM's default), so a range can also lower one.
DEFAULT_PRIORITY = 35
# The operator's bounds unless set (EngineConfig and the cache manager share them): half the cache may be
# retained, for at most OpenAI's longest retention, 24 hours.
DEFAULT_MAX_RETAINED_FRACTION = 0.5
DEFAULT_MAX_RETENTION_TTL_S = 86400.0


@dataclass(frozen=True, slots=True)
class RetentionRange:
    """Tokens ``start`` .. ``end`` (exclusive; None: to the end of the request, generated tokens included) are
    kept at ``priority`` for ``ttl_s`` seconds after their block was last used (None: as long as the priority
    lets them stay)."""

    start: int
    end: int | None = None
    priority: int = DEFAULT_PRIORITY
    ttl_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise ValueError(f"retention start must be a token index >= 0, got {self.start!r}")
        if self.end is not None and (
            isinstance(self.end, bool) or not isinstance(self.end, int) or self.end <= self.start
        ):
            raise ValueError(f"retention end must be a token index > start ({self.start}) or None, got {self.end!r}")
        if (
            isinstance(self.priority, bool)
            or not isinstance(self.priority, int)
            or not (MIN_PRIORITY <= self.priority <= MAX_PRIORITY)
        ):
            raise ValueError(
                f"retention priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {self.priority!r}"
            )
        if self.ttl_s is not None and (
            isinstance(self.ttl_s, bool)
            or not isinstance(self.ttl_s, int | float)
            or not math.isfinite(self.ttl_s)
            or self.ttl_s <= 0
        ):
            raise ValueError(f"retention ttl_s must be a positive number of seconds or None, got {self.ttl_s!r}")


def check_retention(ranges: Sequence[RetentionRange], num_prompt_tokens: int) -> tuple[RetentionRange, ...]:
    """The ranges as a tuple; ValueError for one that is not a ``RetentionRange`` or reaches past the prompt (the
    input processor refuses it before the core sees it, and the core's request checks again: misuse)."""
    for directive in ranges:
        if not isinstance(directive, RetentionRange):
            raise ValueError(f"retention holds RetentionRange values, not {directive!r}")
        if directive.start >= num_prompt_tokens or (directive.end is not None and directive.end > num_prompt_tokens):
            end = "the end" if directive.end is None else directive.end
            raise ValueError(
                f"retention range {directive.start}..{end} is past the prompt of {num_prompt_tokens} tokens"
            )
    return tuple(ranges)


@dataclass(frozen=True, slots=True)
class BlockDirective:
    """A range as the cache manager applies it: blocks ``first`` .. ``end`` - 1 (None: to the end) get
    ``priority`` for ``ttl_s`` seconds (already clamped to the operator's largest TTL)."""

    first: int
    end: int | None
    priority: int
    ttl_s: float

    def covers(self, block_index: int) -> bool:
        return self.first <= block_index and (self.end is None or block_index < self.end)


def block_directives(
    ranges: Sequence[RetentionRange], block_size: int, max_ttl_s: float
) -> tuple[tuple[BlockDirective, ...], bool]:
    """The ranges on whole blocks, best first, and whether a TTL was clamped to ``max_ttl_s``.

    A block gets a range's retention only when it lies wholly inside the range: a breakpoint means "the prefix up
    to here", and a block that also holds tokens after it hashes those tokens too, so the next request that shares
    the prefix would not hit it anyway. Where ranges overlap, the highest priority wins, then the longest TTL. A
    range at the default priority changes nothing (its TTL would return the block to where it is) and is dropped;
    a range without a TTL keeps its blocks for the largest TTL the operator allows.
    """
    directives: list[BlockDirective] = []
    clamped = False
    for directive in ranges:
        if directive.priority == DEFAULT_PRIORITY:
            continue
        first = -(-directive.start // block_size)
        end = None if directive.end is None else directive.end // block_size
        if end is not None and end <= first:
            continue  # no whole block inside
        ttl_s = max_ttl_s if directive.ttl_s is None else min(directive.ttl_s, max_ttl_s)
        clamped |= directive.ttl_s is not None and directive.ttl_s > max_ttl_s
        directives.append(BlockDirective(first, end, directive.priority, ttl_s))
    directives.sort(key=lambda d: (-d.priority, -d.ttl_s))
    return tuple(directives), clamped


def check_bounds(
    max_retained_fraction: float, max_retention_ttl_s: float, max_tenant_retained_fraction: float | None
) -> None:
    """ValueError naming the operator's retention bound that is out of range (the config and the manager check)."""
    if not 0.0 <= max_retained_fraction <= 1.0:
        raise ValueError(f"max_retained_fraction must be in [0, 1], got {max_retained_fraction}")
    if not max_retention_ttl_s > 0:
        raise ValueError(f"max_retention_ttl_s must be positive, got {max_retention_ttl_s}")
    if max_tenant_retained_fraction is not None and not 0.0 <= max_tenant_retained_fraction <= 1.0:
        raise ValueError(f"max_tenant_retained_fraction must be in [0, 1] or None, got {max_tenant_retained_fraction}")
