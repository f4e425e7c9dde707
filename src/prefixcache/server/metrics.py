"""Prometheus metrics and the periodic stats log line, named like vLLM's (``prefixcache:`` prefix).

Latencies are observed per token as outputs are dispatched. Engine-wide numbers (prefix-cache
counters, KV usage, queue lengths) come with every output batch of the engine core; its counters are
cumulative, so the Prometheus counters are advanced by the difference since the last batch. The offload
tiers' counters are exported as they were in the latest batch, one series per tier (``tier="cpu"`` etc.).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixcache.core import MISS_REASONS
from prefixcache.core.block_pool import PRIORITY_CLASSES
from prefixcache.engine import EngineStats
from prefixcache.offload.store import TierStats

logger = logging.getLogger(__name__)
_snapshot = msgspec.msgpack.Encoder().encode

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class ServerMetrics:
    """Every metric in its own registry (several servers can live in one process, e.g. in tests)."""

    def __init__(self, model_name: str) -> None:
        self.registry = registry = CollectorRegistry()
        label = {"model_name": model_name}

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"prefixcache:{name}", doc, list(label), registry=registry).labels(**label)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"prefixcache:{name}", doc, list(label), registry=registry).labels(**label)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"prefixcache:{name}", doc, list(label), buckets=buckets, registry=registry).labels(
                **label
            )

        self._engine_counters = {
            "prefix_cache_queries": counter(
                "prefix_cache_queries", "Prompt tokens looked up in the prefix cache (once per request)."
            ),
            "prefix_cache_hits": counter(
                "prefix_cache_hits", "Prompt tokens whose K/V was reused (shared blocks and sub-block copies)."
            ),
            "prefix_cache_copied_tokens": counter(
                "prefix_cache_copied_tokens", "Of the hits, prompt tokens copied from a sub-block prefix match."
            ),
            "prefix_cache_preempted_queries": counter(
                "prefix_cache_preempted_queries",
                "Tokens looked up again by preempted requests when they resume (not in prefix_cache_queries).",
            ),
            "prefix_cache_preempted_hits": counter(
                "prefix_cache_preempted_hits",
                "Of those, tokens found cached: mostly their own blocks, not sharing (not in prefix_cache_hits).",
            ),
            "num_preemptions": counter("num_preemptions", "Requests preempted because KV blocks ran out."),
            "kv_events_dropped": counter(
                "kv_events_dropped", "KV cache event batches dropped because the publisher's queue was full."
            ),
            "prefix_cache_retained_read_tokens": counter(
                "prefix_cache_retained_read_tokens",
                "Prompt tokens read from retained blocks (a retention directive raised their priority).",
            ),
            "prefix_cache_retained_written_tokens": counter(
                "prefix_cache_retained_written_tokens",
                "Prompt tokens computed into blocks the request's retention directives marked retained.",
            ),
            "state_checkpoints_saved": counter(
                "state_checkpoints_saved", "Recurrent-state checkpoints saved (models with recurrent layers)."
            ),
            "state_checkpoint_hits": counter(
                "state_checkpoint_hits", "Admissions that restored a recurrent-state checkpoint."
            ),
            "state_checkpoints_evicted": counter(
                "state_checkpoints_evicted", "Recurrent-state checkpoints evicted to make room for new ones."
            ),
        }
        self._seen: dict[str, int] = {}  # the engine's cumulative counters as last read
        self._last_stats: bytes | None = None  # the last stats gone through, encoded
        missed = Counter(
            "prefixcache:prefix_cache_missed_tokens",
            "Prompt tokens not found in the prefix cache, by reason: new (never cached, or dropped by a reset), "
            "evicted (recently evicted under pressure: a larger cache would have served it), expired (evicted "
            "after its retention TTL ended), evicted_below_retained (a plain block evicted while retained blocks "
            "stayed), partial_block (after the last whole block a lookup may return), skipped (the request did "
            "not read the cache).",
            [*label, "reason"],
            registry=registry,
        )
        self._missed = {reason: missed.labels(**label, reason=reason) for reason in MISS_REASONS}
        self._by_priority_class: dict[str, dict[str, Counter]] = {}
        for event, doc in _BLOCK_EVENTS.items():
            family = Counter(f"prefixcache:kv_cache_block_{event}", doc, [*label, "priority_class"], registry=registry)
            self._by_priority_class[event] = {c: family.labels(**label, priority_class=c) for c in PRIORITY_CLASSES}
        self.hit_rate = gauge("prefix_cache_hit_rate", "Prefix cache hit rate over the last 1,000 requests.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 means 100 percent).")
        self.num_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token of finished requests.", E2E_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that reached their first token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._request_success = Counter(
            "prefixcache:request_success",
            "Requests that finished, by finish reason (abort: the client left, the server shut down, or the "
            "request failed in the engine).",
            [*label, "finished_reason"],
            registry=registry,
        )
        self._label = label
        self.tiers = OffloadTierCollector(model_name)
        registry.register(self.tiers)
        self.retained = RetainedBlocksCollector(model_name)
        registry.register(self.retained)
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self._logged_prompt_tokens = self._logged_generation_tokens = 0
        self._logged_at = time.monotonic()

    def observe_first_token(self, ttft: float, num_prompt_tokens: int, num_new_tokens: int) -> None:
        self.ttft.observe(ttft)
        self.prompt_tokens.inc(num_prompt_tokens)
        self._num_prompt_tokens += num_prompt_tokens
        self._count_generated(num_new_tokens)

    def observe_next_token(self, itl: float, num_new_tokens: int) -> None:
        self.itl.observe(itl)
        self._count_generated(num_new_tokens)

    def observe_finished(self, finish_reason: str | None, e2e: float) -> None:
        self.e2e.observe(e2e)
        self._request_success.labels(**self._label, finished_reason=finish_reason or "unknown").inc()

    def update(self, stats: EngineStats) -> None:
        """Bring engine-wide metrics up to ``stats``; a stale read (lower counters) changes no counter.

        The same stats as the last (most decode steps: no request came or went, no block filled) change nothing,
        so they are not gone through again: their encoding is compared, a few percent of the cost (the encoding,
        not the objects, which a caller may have changed since)."""
        snapshot = _snapshot(stats)
        if snapshot == self._last_stats:
            return
        self._last_stats = snapshot
        for name, counter in self._engine_counters.items():
            self._advance(name, counter, getattr(stats, name))
        for reason, value in stats.prefix_cache_missed_tokens.items():
            self._advance(f"missed_{reason}", self._missed[reason], value)
        for event, counters in self._by_priority_class.items():
            for priority_class, value in getattr(stats, f"kv_cache_block_{event}").items():
                self._advance(f"block_{event}_{priority_class}", counters[priority_class], value)
        self.retained.latest = stats.retained_blocks_by_tenant
        self.hit_rate.set(stats.rolling_hit_rate)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.tiers.latest = stats.kv_offload

    def _advance(self, key: str, counter: Counter, value: int) -> None:
        seen = self._seen.get(key, 0)
        if value > seen:
            counter.inc(value - seen)
            self._seen[key] = value

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def log_stats(self, stats: EngineStats, now: float) -> None:
        """vLLM's periodic line: throughput since the last call, load and the rolling hit rate.

        Silent while the server is idle, so an idle server's log does not fill up.
        """
        prompt = self._num_prompt_tokens - self._logged_prompt_tokens
        generation = self._num_generation_tokens - self._logged_generation_tokens
        elapsed = now - self._logged_at
        self._logged_prompt_tokens = self._num_prompt_tokens
        self._logged_generation_tokens = self._num_generation_tokens
        self._logged_at = now
        if not (prompt or generation or stats.num_running or stats.num_waiting):
            return
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            prompt / elapsed if elapsed else 0.0,
            generation / elapsed if elapsed else 0.0,
            stats.num_running,
            stats.num_waiting,
            100 * stats.kv_cache_usage,
            100 * stats.rolling_hit_rate,
        )

    def _count_generated(self, num_tokens: int) -> None:
        self.generation_tokens.inc(num_tokens)
        self._num_generation_tokens += num_tokens


_BLOCK_EVENTS = {
    "hits": "KV blocks hit, by priority class (retained: above the default priority; low: below; expired: its "
    "TTL ended while it was free).",
    "evictions": "Cached KV blocks evicted for reuse, by priority class.",
    "expirations": "Free KV blocks whose retention TTL ended (back at the default priority), by the class they had.",
}


class RetainedBlocksCollector(Collector):
    """Blocks above the default priority in the latest output batch, one series per tenant (``tenant=""`` for
    requests without an API key), as ``prefixcache:kv_cache_retained_blocks``."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.latest: dict[str, int] = {}

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "prefixcache:kv_cache_retained_blocks",
            "KV blocks a retention directive keeps above the default priority (free or in use), by tenant.",
            labels=["model_name", "tenant"],
        )
        for tenant, count in sorted(self.latest.items()):
            family.add_metric([self.model_name, tenant], float(count))
        yield family


_TIER_COUNTERS = {
    "hits": "Blocks found in the tier at lookup (read and verified).",
    "hit_tokens": "Prompt tokens served from the tier into the device cache.",
    "blocks_loaded": "Blocks loaded from the tier into the device cache.",
    "bytes_loaded": "Bytes loaded from the tier.",
    "load_seconds": "Time spent reading from the tier.",
    "blocks_stored": "Blocks written to the tier.",
    "bytes_stored": "Bytes written to the tier.",
    "store_seconds": "Time spent writing to the tier (background writer).",
    "evictions": "Blocks evicted from the tier (LRU beyond its capacity).",
    "bad_records": "Truncated, corrupt or foreign records read from the tier (each a miss).",
    "errors": "Failed reads, writes or connections of the tier.",
}
_TIER_GAUGES = {
    "capacity_bytes": "The tier's capacity.",
    "used_bytes": "Bytes the tier holds.",
    "num_blocks": "Blocks the tier holds.",
    "available": "1 while the tier is usable, 0 while it is disabled or unreachable.",
}


class OffloadTierCollector(Collector):
    """The offload tiers' statistics of the latest output batch, as ``prefixcache:kv_offload_*{tier=...}``."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.latest: list[TierStats] = []

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "tier"]
        families: list[CounterMetricFamily | GaugeMetricFamily] = [
            CounterMetricFamily(f"prefixcache:kv_offload_{name}", doc, labels=labels)
            for name, doc in _TIER_COUNTERS.items()
        ]
        for name, doc in _TIER_GAUGES.items():
            families.append(GaugeMetricFamily(f"prefixcache:kv_offload_{name}", doc, labels=labels))
        names = [*_TIER_COUNTERS, *_TIER_GAUGES]
        for tier in self.latest:
            for family, name in zip(families, names, strict=True):
                family.add_metric([self.model_name, tier.medium.lower()], float(getattr(tier, name)))
        yield from families
