"""The start-up summary ``prefixcache serve`` writes from the core's handshake and first stats: the tiers that
are live, and a KV cache that holds less than the context."""

from prefixcache.config import EngineConfig
from prefixcache.engine.messages import EngineInfo, EngineStats
from prefixcache.offload.store import TierStats
from prefixcache.server.startup import startup_lines

INFO = EngineInfo("tiny", 1024, 512, 4, 40, "sha256", "prefixcache", True, 160)


def stats(*tiers: TierStats) -> EngineStats:
    return EngineStats(0, 0, 0, {}, 0.0, 0.0, 0, 0, 0.0, 0, 0, 40, 4, kv_offload=list(tiers))


def test_a_tier_that_failed_to_open_is_listed_as_unavailable(tmp_path):
    config = EngineConfig(model="tiny", kv_offload_cpu="1GiB", kv_offload_disk=f"{tmp_path}:1GiB")
    live = stats(TierStats("CPU", 1 << 30), TierStats("DISK", 1 << 30, available=False))
    tiers = startup_lines(INFO, config, live)[2]
    assert tiers == (
        f"offload tiers: CPU 1.0 GiB (write_back), DISK {tmp_path} 1.0 GiB (UNAVAILABLE: see the error above; "
        "serving without it)"
    )
    assert startup_lines(INFO, config, stats())[2].count("(off: prefix caching is off)") == 2  # none built
    assert startup_lines(INFO, EngineConfig(model="tiny"), stats())[2] == "offload tiers: none"


def test_a_kv_cache_smaller_than_the_context_says_what_requests_may_grow_to():
    kv_line = startup_lines(INFO, EngineConfig(model="tiny"), stats())[1]
    assert "less than the context: requests up to 160 tokens" in kv_line
    roomy = EngineInfo("tiny", 128, 512, 4, 40, "sha256", "prefixcache", True, 160)
    assert "less than the context" not in startup_lines(roomy, EngineConfig(model="tiny"), stats())[1]
