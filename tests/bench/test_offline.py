"""The offline benchmark: its verdicts read as results, not as defects, and its comparison cannot flatter the cache."""

import pytest

from prefixcache.bench.offline import (
    CEILING_SLACK,
    compare_cache_off_on,
    describe_output_match,
    describe_prefill_part,
    describe_speedup,
    run_order,
    split_prefill,
    synthetic_workload,
)
from prefixcache.config import EngineConfig


def test_identical_outputs_are_reported_as_such():
    report = {"num_outputs": 16, "output_mismatches": 0, "dtype": "bfloat16"}
    assert describe_output_match(report) == "greedy outputs with and without the cache: identical (16 of 16)"


def test_bfloat16_differences_are_explained():
    text = describe_output_match({"num_outputs": 16, "output_mismatches": 2, "dtype": "bfloat16"})
    assert "14 of 16 identical; 2 differ" in text and "bfloat16 rounds" in text and "False" not in text


def test_float32_differences_are_flagged_as_unexpected():
    text = describe_output_match({"num_outputs": 16, "output_mismatches": 1, "dtype": "float32"})
    assert "1 of 16 DIFFER (unexpected in float32)" in text


def test_cache_off_and_on_alternate_which_runs_first():
    assert run_order(1) == [False, True]
    assert run_order(3) == [False, True, True, False, False, True]


def speedup_report(speedup: float, hit_rate: float) -> dict:
    ceiling = 1 / (1 - hit_rate)
    runs = [{"cache": "off", "elapsed_s": speedup}, {"cache": "on", "elapsed_s": 1.0}]
    return {"speedup": speedup, "ceiling": ceiling, "hit_rate": hit_rate, "runs": runs}


def test_a_speedup_above_its_ceiling_is_a_measurement_error_not_a_result():
    text = describe_speedup(speedup_report(5.12, 0.778))
    assert "MEASUREMENT ERROR: speedup 5.12x is above its ceiling 4.50x" in text and "not a result" in text
    assert "of the ceiling)" not in text


def test_a_speedup_just_above_its_ceiling_is_at_the_ceiling_not_an_error():
    text = describe_speedup(speedup_report(3.01, 2 / 3))
    assert "speedup 3.01x  ceiling 3.00x: at the ceiling" in text and "ERROR" not in text
    assert "MEASUREMENT ERROR" in describe_speedup(speedup_report(3.2, 2 / 3))  # 7% above: disturbed runs


def test_a_speedup_below_its_ceiling_is_reported_with_it():
    text = describe_speedup(speedup_report(3.6, 0.778))
    assert "runs in order (s): off 3.60, on 1.00" in text
    assert "speedup 3.60x  ceiling 4.50x  (0.80 of the ceiling)" in text and "ERROR" not in text


def test_the_prefill_part_is_held_to_the_ceiling_and_the_rest_bounds_the_whole_run():
    # Uncached: 9 s of prefill and 1 s after it; cached: 3.2 s and 0.8 s. Cutting exactly two thirds of the 9 s
    # and none of the 1 s gives 10 / (3 + 1) = 2.5x for the whole run.
    split = split_prefill(10.0, 4.0, 9.0, 3.2, 2 / 3)
    assert split["rest_without_cache_s"] == pytest.approx(1.0) and split["rest_with_cache_s"] == pytest.approx(0.8)
    assert split["prefill_speedup"] == pytest.approx(9 / 3.2) and split["ceiling"] == pytest.approx(3.0)
    assert split["speedup"] == pytest.approx(2.5) and split["ceiling_with_rest"] == pytest.approx(2.5)
    cpu = split_prefill(5.0, 2.0, 4.5, 1.6, 2 / 3)
    text = describe_prefill_part({"prefill_part": {"elapsed_s": split, "cpu_s": cpu}, "output_len": 8})
    elapsed, cpu_text = text.split("\nby CPU time: ")
    assert elapsed.startswith("by elapsed time: whole run 2.50x (0.83 of the ceiling); ")
    assert "prefill part alone (1 output token) off 9.00 s, on 3.20 s: 2.81x (0.94 of the ceiling)" in elapsed
    assert "the rest (7 more tokens a request" in elapsed and "off 1.00 s, on 0.80 s" in elapsed
    assert "would give 2.50x for the whole run (measured: 1.00 of that)" in elapsed
    assert cpu_text.startswith("whole run 2.50x") and "off 4.50 s, on 1.60 s: 2.81x" in cpu_text


def test_the_comparison_warms_up_alternates_and_compares_each_engines_best_run(tiny_loaded, tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", block_size=4, num_blocks=256)
    workload = synthetic_workload(
        500, num_prompts=6, prefix_len=24, suffix_len=8, num_prefixes=2, repeat=1, max_tokens=3
    )
    report = compare_cache_off_on(tiny_loaded, workload, config, rounds=2)
    assert [r["cache"] for r in report["runs"]] == ["off", "on", "on", "off"]
    for mode, key in (("off", "without_cache"), ("on", "with_cache")):
        assert report[key]["elapsed_s"] == min(r["elapsed_s"] for r in report["runs"] if r["cache"] == mode)
    # Every timed run starts from an empty cache: 2 of the 6 prompts compute their prefix, 4 reuse it (24 of 32).
    assert report["hit_rate"] == pytest.approx(4 * 24 / (6 * 32))
    assert report["outputs_identical"] and report["dtype"] == "float32"
    assert report["measurement_error"] == (report["speedup"] > report["ceiling"] * CEILING_SLACK)
    # The prefill part runs the same prompts from an empty cache, so it hits exactly as much.
    assert report["prefill_part"]["elapsed_s"]["ceiling"] == report["ceiling"] and report["output_len"] == 3
    assert report["prefill_part"]["elapsed_s"]["speedup"] == report["speedup"]
    assert report["with_cache"]["cpu_s"] > 0 and set(report["prefill_part"]) == {"elapsed_s", "cpu_s"}
    assert [r["cache"] for r in report["prefill_runs"]] == ["off", "on", "on", "off"]
    prefill_on = min(r["elapsed_s"] for r in report["prefill_runs"] if r["cache"] == "on")
    assert report["prefill_part"]["elapsed_s"]["prefill_with_cache_s"] == prefill_on
