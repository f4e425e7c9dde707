"""The explanation as a terminal report, as JSON, and as a picture."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefixcache.core.block_pool import EVICTED, EVICTION_CAUSES
from prefixcache.explain.analysis import (
    CORE_REASON_LABELS,
    KINDS,
    REASON_LABELS,
    REASONS,
    REFINES,
    DivergenceSummary,
    Explanation,
    RequestExplanation,
)
from prefixcache.explain.log import LineError

LABEL_WIDTH = 38


def format_report(explanation: Explanation, source: str, errors: list[LineError], max_rows: int) -> str:
    config = explanation.config
    block = f"{config.block_size}-token blocks"
    lines = [
        f"{source}: {len(explanation.requests):,} requests"
        + (f" ({len(errors)} bad lines skipped)" if errors else "")
        + f", {explanation.prompt_tokens:,} prompt tokens; {block}; requests in log order, each finished before"
        " the next, prompts only",
        "",
        "hit rate (prompt tokens reused / prompt tokens)",
        _rate_line("infinite cache, token-exact", explanation.infinite_hit_rate),
        _rate_line(f"infinite cache, {block}", explanation.block_hit_rate)
        + f"   (alignment loss {explanation.alignment_loss:.3f})",
    ]
    if explanation.capacity_hit_rate is not None:
        capacity = f"{config.capacity_tokens:,}-token cache ({config.eviction_policy})"
        lines.append(_rate_line(capacity, explanation.capacity_hit_rate) + "   (replayed through KVCacheManager)")
        if explanation.breakpoint_hit_rate is not None:
            lines.append(
                _rate_line("  with the breakpoint", explanation.breakpoint_hit_rate)
                + f"   ({config.breakpoint} on {explanation.breakpoint_requests:,} of"
                f" {len(explanation.requests):,} requests, same replay)"
            )
        lines.append(f"  {_directives_line(explanation)}")
        if config.has_state:
            lines += _checkpoint_lines(explanation)
    if explanation.live_hit_rate is not None:
        lines.append(_rate_line("the server's cache now", explanation.live_hit_rate))
    lines += ["", "missed prompt tokens by reason (the engine's reasons, as /metrics counts them, then split finer)"]
    total_tokens = explanation.prompt_tokens
    for core_reason, total in explanation.missed_by_core_reason.items():
        if core_reason == "skipped" or (core_reason in EVICTION_CAUSES and explanation.capacity_hit_rate is None):
            continue  # explain reads every prompt's cache; without a capacity nothing is evicted
        if core_reason == "no_checkpoint" and not config.has_state:
            continue  # only a model with recurrent layers needs checkpoints
        if core_reason not in (EVICTED, "no_checkpoint") and not total and not explanation.directed_requests:
            continue  # without directives nothing expires or is lost to retained blocks
        lines.append(_count_line(CORE_REASON_LABELS[core_reason], total, total_tokens))
        for reason in (r for r in REASONS if REFINES[r] == core_reason):
            lines.append(_count_line("  " + REASON_LABELS[reason], explanation.missed[reason], total_tokens))
    lines += ["", "where prompts part from the earlier prompt they share most with"]
    lines += _divergence_lines(explanation)
    lines += ["", f"requests (first {min(max_rows, len(explanation.requests))} of {len(explanation.requests):,})"]
    lines += _request_rows(explanation, max_rows)
    if errors:
        lines += ["", "skipped lines"] + [f"  line {e.line}: {e.message}" for e in errors]
    return "\n".join(lines)


def _checkpoint_lines(explanation: Explanation) -> list[str]:
    """A recurrent model's replay: its checkpoint budget and policy, and the what-if of a checkpoint where each
    prompt parts from the cached path."""
    config = explanation.config
    policy = config.checkpoint_policy
    sparse = f"sparse every {policy.sparse_every_blocks} blocks" if policy.sparse_every_blocks else "no sparse ones"
    chunks = f"prefill in chunks of {config.max_chunk_tokens:,}" if config.max_chunk_tokens else "prompts in one step"
    saved = explanation.checkpoint_would_save
    helped = sum(bool(r.checkpoint_would_save) for r in explanation.requests)
    return [
        f"  recurrent state: {config.num_checkpoint_slots:,} checkpoint slots ({sparse}, finish, junction and"
        f" message-end hints), {chunks}",
        _rate_line("  with a checkpoint where each parts", explanation.checkpoint_hit_rate)
        + f"   (+{saved:,} tokens on {helped:,} requests: what the attention blocks held past each hit)",
    ]


def _directives_line(explanation: Explanation) -> str:
    """What the replay honoured: the log's directives, and whether its TTLs followed the log's timestamps."""
    directed = explanation.directed_requests
    text = f"retention directives on {directed:,} requests" if directed else "no retention directives in the log"
    if explanation.timed:
        return text + "; TTLs timed by the log's timestamps"
    return text + "; no timestamps on every line, so no time passes and no TTL ends (directives act by priority)"


def _count_line(label: str, count: int, total: int) -> str:
    return f"  {label:<{LABEL_WIDTH}}{count:>10,}  {count / total:6.1%}"


def _rate_line(label: str, rate: float) -> str:
    return f"  {label:<{LABEL_WIDTH}}{rate:10.3f}"


def _divergence_lines(explanation: Explanation) -> list[str]:
    summary = explanation.divergence
    if summary is None:
        return ["  none: no prompt shares a prefix with an earlier one and then differs"]
    span = f"token {summary.start}" if summary.start == summary.end else f"tokens {summary.start}–{summary.end}"
    lines = [
        f"  {summary.count / summary.total:.0%} of divergences ({summary.count} of {summary.total}) start at {span}:"
        f" {KINDS[summary.kind]}",
        f"    {_where(summary)}",
        f"    line {summary.example_line:<7} `{summary.this_context}`",
        f"    line {summary.other_line:<7} `{summary.other_context}`",
        f"  fix: {summary.fix}",
    ]
    if summary.fixed_block_hit_rate is not None:
        start, end = summary.varying_span
        lines.append(
            f"  with the varying span (tokens {start}–{end} in line {summary.example_line}: `{summary.varying_text}`) "
            f"moved to the end of the {summary.prompts_rewritten} prompts that have it: hit rate "
            f"{summary.fixed_block_hit_rate:.3f} at {explanation.config.block_size}-token blocks "
            f"(now {explanation.block_hit_rate:.3f})"
        )
    return lines


def _where(summary: DivergenceSummary) -> str:
    """Which part of the prompt the example parts in: a chat message, the chat template's own text, or the prompt."""
    if summary.num_messages is None:
        return f"in the prompt of line {summary.example_line} (⟦…⟧ marks what differs):"
    if summary.message_index is None:
        return f"in the chat template's text around the messages of line {summary.example_line} (⟦…⟧ marks it):"
    return (
        f"in message {summary.message_index + 1} of {summary.num_messages} ({summary.message_role}) of line "
        f"{summary.example_line} (⟦…⟧ marks what differs):"
    )


def _request_rows(explanation: Explanation, max_rows: int) -> list[str]:
    capacity = explanation.capacity_hit_rate is not None
    live = explanation.live_hit_rate is not None
    state = explanation.config.has_state
    header = f"  {'line':>6} {'tokens':>7} {'infinite':>8} {'blocks':>7}"
    header += f" {'cache':>6}" * capacity + f" {'+ckpt':>6}" * state + f" {'server':>6}" * live
    header += f"  {'first miss':<18} {'shares with':>11} {'tokens':>6}  parts at"
    rows = [header]
    for r in explanation.requests[:max_rows]:
        row = f"  {r.line:>6} {r.prompt_tokens:>7} {_rate(r.infinite_hit, r):>8} {_rate(r.block_hit, r):>7}"
        if capacity:
            row += f" {_rate(r.capacity_hit, r):>6}"
        if state:  # tokens a checkpoint where it parts would have saved
            row += f" {r.checkpoint_would_save:>6}"
        if live:
            row += f" {_rate(r.live_cached, r):>6}"
        match = "—" if r.match_line is None else f"line {r.match_line}"
        row += f"  {r.reason:<18} {match:>11} {r.shared_tokens:>6}  "
        if r.divergence is not None:
            d = r.divergence
            row += f"{d.index}: `{d.this_text[:24]}` / `{d.other_text[:24]}`"
        elif r.match_line is not None and r.shared_tokens == r.prompt_tokens:
            row += "repeats it"
        elif r.match_line is not None:
            row += "extends it"
        rows.append(row)
    return rows


def _rate(tokens: int, request: RequestExplanation) -> str:
    return f"{tokens / request.prompt_tokens:.2f}"


def to_json(explanation: Explanation, source: str, errors: list[LineError]) -> dict[str, Any]:
    return {
        "source": source,
        "config": asdict(explanation.config),
        "num_requests": len(explanation.requests),
        "prompt_tokens": explanation.prompt_tokens,
        "hit_rate": {
            "infinite_token_exact": explanation.infinite_hit_rate,
            "infinite_blocks": explanation.block_hit_rate,
            "alignment_loss": explanation.alignment_loss,
            "capacity": explanation.capacity_hit_rate,
            "server_now": explanation.live_hit_rate,
            "with_breakpoint": explanation.breakpoint_hit_rate,
            "with_checkpoints_where_prompts_part": explanation.checkpoint_hit_rate,
        },
        "checkpoint_would_save": explanation.checkpoint_would_save,
        "breakpoint_requests": explanation.breakpoint_requests,
        "directed_requests": explanation.directed_requests,
        "timed": explanation.timed,
        "missed_tokens": explanation.missed_by_core_reason,
        "missed_tokens_refined": explanation.missed,
        "divergence": None if explanation.divergence is None else asdict(explanation.divergence),
        "requests": [_request_json(r) for r in explanation.requests],
        "errors": [asdict(e) for e in errors],
    }


def _request_json(request: RequestExplanation) -> dict[str, Any]:
    """A request's fields and the properties derived from them."""
    derived = ("reason", "core_reason", "checkpoint_would_save")
    return asdict(request) | {name: getattr(request, name) for name in derived}


def write_plot(explanation: Explanation, path: Path, title: str) -> None:
    """One bar per request (log order, top down) along the token axis: what the cache reuses in whole blocks, what
    a recurrent model computed again for want of a checkpoint, what a finite cache lost to eviction, what block
    alignment loses, and what is computed; a tick marks where the prompt parts from the earlier one. Below, where
    prompts part, as a histogram."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    requests = explanation.requests
    capacity = explanation.capacity_hit_rate is not None
    fig = Figure(figsize=(10, 7.5))
    FigureCanvasAgg(fig)
    bars, histogram = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    y = list(range(len(requests)))
    reused = [r.capacity_hit if capacity else r.block_hit for r in requests]
    no_checkpoint = [r.checkpoint_would_save for r in requests]
    evicted = [r.block_hit - reused[i] - no_checkpoint[i] for i, r in enumerate(requests)]
    aligned = [r.infinite_hit - r.block_hit for r in requests]
    computed = [r.prompt_tokens - r.infinite_hit for r in requests]
    height = 1.0 if len(requests) > 60 else 0.8
    left = [0] * len(requests)
    segments = [
        (reused, "#2e7d32", f"reused ({explanation.config.capacity_tokens:,}-token cache)" if capacity else "reused"),
        (no_checkpoint, "#7b1fa2", "cached, no state checkpoint where it parts"),
        (evicted, "#ef6c00", "evicted (an infinite cache would reuse)"),
        (aligned, "#a5d6a7", "shared but not a whole block"),
        (computed, "#bdbdbd", "computed"),
    ]
    for widths, color, label in segments:
        if any(widths):
            bars.barh(y, widths, left=left, height=height, color=color, label=label, linewidth=0)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    parted = [(r.divergence.index, i) for i, r in enumerate(requests) if r.divergence is not None]
    if parted:
        bars.scatter(*zip(*parted, strict=True), marker="|", color="#c62828", s=60, label="parts from earlier prompt")
    bars.invert_yaxis()
    bars.set_ylabel("request (log order)")
    bars.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=3, fontsize="small", frameon=False)
    fig.suptitle(f"{title}: how far each prompt shares a prefix with an earlier one, and where it parts")
    summary = explanation.divergence
    if parted:
        histogram.hist([p for p, _ in parted], bins=min(100, max(10, len(parted))), color="#c62828")
        if summary is not None:
            histogram.axvspan(summary.start - 0.5, summary.end + 0.5, color="#c62828", alpha=0.15)
            text = f"{summary.count / summary.total:.0%} part at tokens {summary.start}–{summary.end}"
            if summary.fixed_block_hit_rate is not None:
                text += f"\nvarying span moved to the end: hit rate {explanation.block_hit_rate:.2f} → "
                text += f"{summary.fixed_block_hit_rate:.2f}"
            histogram.annotate(text, xy=(0.99, 0.95), xycoords="axes fraction", ha="right", va="top", fontsize="small")
    histogram.set_xlabel("token index")
    histogram.set_ylabel("divergences")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
