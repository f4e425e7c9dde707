"""Engine-wide metrics from the stats of output batches: offload tiers per tier, dropped KV event batches."""

from prometheus_client.parser import text_string_to_metric_families

from prefixcache.core import MISS_REASONS
from prefixcache.engine import EngineStats
from prefixcache.offload.store import TierStats
from prefixcache.server.metrics import ServerMetrics


def engine_stats(tiers: list[TierStats], kv_events_dropped: int = 0, **counters: int) -> EngineStats:
    counters = {"prefix_cache_queries": 0, "prefix_cache_hits": 0} | counters
    return EngineStats(
        prefix_cache_copied_tokens=0,
        prefix_cache_missed_tokens=dict.fromkeys(MISS_REASONS, 0),
        prefix_cache_hit_rate=0.0,
        rolling_hit_rate=0.0,
        num_requests=0,
        num_preemptions=0,
        kv_cache_usage=0.0,
        num_running=0,
        num_waiting=0,
        num_blocks=8,
        block_size=4,
        kv_offload=tiers,
        kv_events_dropped=kv_events_dropped,
        **counters,
    )


def samples(metrics: ServerMetrics) -> dict[tuple[str, str | None], float]:
    text = metrics.render().decode()
    return {
        (sample.name, sample.labels.get("tier")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_each_tier_is_a_labelled_series_that_follows_the_latest_batch():
    metrics = ServerMetrics("m")
    assert not any(name.startswith("prefixcache:kv_offload") for name, _ in samples(metrics))  # no tiers, no series
    host = TierStats("CPU", capacity_bytes=1024, used_bytes=512, num_blocks=2, hits=3, hit_tokens=12, errors=0)
    disk = TierStats("DISK", capacity_bytes=4096, available=False, bad_records=1, errors=2)
    metrics.update(engine_stats([host, disk]))
    seen = samples(metrics)
    assert seen[("prefixcache:kv_offload_hits_total", "cpu")] == 3
    assert seen[("prefixcache:kv_offload_hit_tokens_total", "cpu")] == 12
    assert seen[("prefixcache:kv_offload_used_bytes", "cpu")] == 512
    assert seen[("prefixcache:kv_offload_available", "cpu")] == 1
    assert seen[("prefixcache:kv_offload_available", "disk")] == 0
    assert seen[("prefixcache:kv_offload_bad_records_total", "disk")] == 1
    assert seen[("prefixcache:kv_offload_errors_total", "disk")] == 2
    host.hits = 5
    metrics.update(engine_stats([host]))
    assert samples(metrics)[("prefixcache:kv_offload_hits_total", "cpu")] == 5


def test_dropped_event_batches_are_counted():
    metrics = ServerMetrics("m")
    metrics.update(engine_stats([], kv_events_dropped=4))
    metrics.update(engine_stats([], kv_events_dropped=7))
    assert samples(metrics)[("prefixcache:kv_events_dropped_total", None)] == 7


def test_hits_of_resumed_preempted_requests_are_their_own_series():
    """They re-read the request's own blocks: counted apart, so prefix_cache_hits means sharing."""
    metrics = ServerMetrics("m")
    counters = dict(prefix_cache_queries=100, prefix_cache_hits=20)
    metrics.update(engine_stats([], **counters, prefix_cache_preempted_queries=50, prefix_cache_preempted_hits=48))
    found = samples(metrics)
    assert found[("prefixcache:prefix_cache_preempted_queries_total", None)] == 50
    assert found[("prefixcache:prefix_cache_preempted_hits_total", None)] == 48
    assert found[("prefixcache:prefix_cache_hits_total", None)] == 20


def test_retention_counters_by_priority_class_and_retained_blocks_by_tenant():
    metrics = ServerMetrics("m")
    by_class = {"expired": 1, "low": 2, "default": 3, "retained": 4}
    metrics.update(
        engine_stats(
            [],
            prefix_cache_retained_read_tokens=32,
            prefix_cache_retained_written_tokens=16,
            kv_cache_block_hits=by_class,
            kv_cache_block_evictions=by_class | {"retained": 9},
            kv_cache_block_expirations={"retained": 5},
            retained_blocks_by_tenant={"tenant-a": 6, "": 2},
        )
    )
    metrics.update(engine_stats([], retained_blocks_by_tenant={"tenant-a": 1}))  # a stale counter read moves none
    text = metrics.render().decode()
    found = {
        (sample.name, sample.labels.get("priority_class") or sample.labels.get("tenant")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert found[("prefixcache:prefix_cache_retained_read_tokens_total", None)] == 32
    assert found[("prefixcache:prefix_cache_retained_written_tokens_total", None)] == 16
    assert found[("prefixcache:kv_cache_block_hits_total", "low")] == 2
    assert found[("prefixcache:kv_cache_block_evictions_total", "retained")] == 9
    assert found[("prefixcache:kv_cache_block_expirations_total", "retained")] == 5
    assert found[("prefixcache:kv_cache_block_expirations_total", "low")] == 0
    assert found[("prefixcache:kv_cache_retained_blocks", "tenant-a")] == 1
    assert ("prefixcache:kv_cache_retained_blocks", "") not in found  # the latest batch has no such tenant


def test_stats_like_the_last_change_nothing_and_a_changed_stats_object_still_counts():
    """Stats equal to the last batch's are skipped, compared as they were then (a caller may change them since)."""
    metrics = ServerMetrics("m")
    host = TierStats("CPU", capacity_bytes=1024, hits=3)
    stats = engine_stats([host], prefix_cache_queries=10, prefix_cache_hits=4, kv_events_dropped=1)
    metrics.update(stats)
    metrics.update(stats)
    again = [TierStats("CPU", capacity_bytes=1024, hits=3)]
    metrics.update(engine_stats(again, prefix_cache_queries=10, prefix_cache_hits=4, kv_events_dropped=1))
    found = samples(metrics)
    assert found[("prefixcache:prefix_cache_queries_total", None)] == 10
    assert found[("prefixcache:kv_events_dropped_total", None)] == 1
    host.hits = 5
    metrics.update(stats)  # the same object, changed
    assert samples(metrics)[("prefixcache:kv_offload_hits_total", "cpu")] == 5
    metrics.update(engine_stats([host], prefix_cache_queries=12, prefix_cache_hits=4, kv_events_dropped=1))
    assert samples(metrics)[("prefixcache:prefix_cache_queries_total", None)] == 12
