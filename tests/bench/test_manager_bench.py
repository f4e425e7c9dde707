"""``prefixcache bench manager`` on a short trace: the JSON report's shape and sane numbers.

The vLLM comparison is not tested: vLLM's CPU build lives in its own venv, absent in CI.
"""

import json
import math

import pytest

from prefixcache.bench.manager import ManagerTraceConfig, make_trace, run

PHASES = ("hashing_us", "lookup_us", "allocate_us", "free_us")

# 200 requests of up to 2,560 tokens with 33 live: 2,000 blocks do not fit (allocation fails), 4,000 do.
CONFIG = ManagerTraceConfig(num_requests=200, num_blocks=4000)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    json_path = tmp_path_factory.mktemp("bench-manager") / "manager.json"
    returned = run(["sha256"], 1, json_path, CONFIG)
    written = json.loads(json_path.read_text())
    assert written == json.loads(json.dumps(returned))
    return written


def test_report_keys(report):
    assert set(report) == {"config", "machine", "mean_prompt_tokens", "results"}
    assert report["config"]["num_requests"] == 200
    assert report["config"]["num_blocks"] == 4000
    assert set(report["results"]) == {"sha256"}
    assert set(report["results"]["sha256"]) == {
        *PHASES,
        "total_us",
        "p50_us",
        "p99_us",
        "hit_rate",
        "hash_ns_per_token",
        "total_us_runs",
    }


def test_values_are_sane(report):
    result = report["results"]["sha256"]
    # Zipf-popular shared prefixes of 512-2048 tokens: many hits, yet every request computes its unique tail.
    assert 0.0 < result["hit_rate"] < 1.0
    assert all(result[phase] > 0 for phase in PHASES)
    # total is the mean of per-request sums, i.e. the sum of the phase means.
    assert math.isclose(result["total_us"], sum(result[phase] for phase in PHASES), rel_tol=1e-9)
    assert 0 < result["p50_us"] <= result["p99_us"]
    assert result["hash_ns_per_token"] > 0
    assert result["total_us_runs"] == [round(result["total_us"], 1)]
    assert 512 + 64 <= report["mean_prompt_tokens"] <= 2048 + 512


def test_trace_is_deterministic_per_seed():
    assert make_trace(CONFIG) == make_trace(ManagerTraceConfig(num_requests=200, num_blocks=4000))
    other = make_trace(ManagerTraceConfig(num_requests=200, num_blocks=4000, seed=1))
    assert other != make_trace(CONFIG)
    assert len(other) == 200


def test_the_retention_replay_is_a_row_beside_the_plain_one():
    report = run(["sha256"], 1, None, CONFIG, retention=True)
    plain, retained = report["results"]["sha256"], report["results"]["sha256+retention"]
    assert set(retained) == set(plain)
    # Every shared prefix marked retained survives the unique tails' evictions: at least the plain hit rate.
    assert retained["hit_rate"] >= plain["hit_rate"]


def test_the_retention_rule_replay_is_a_row_beside_the_plain_one():
    report = run(["sha256"], 1, None, CONFIG, retention_rule="shared")
    plain, ruled = report["results"]["sha256"], report["results"]["sha256+rule:shared"]
    assert set(ruled) == set(plain)
    # The trace's shared prefixes are what the rule keeps: at least the plain hit rate.
    assert ruled["hit_rate"] >= plain["hit_rate"]
