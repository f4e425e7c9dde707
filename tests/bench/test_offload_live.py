"""``prefixcache bench offload`` end to end on the tiny model: every part reports tier hits, nothing is left behind.

Timings are not asserted: the machine is shared and noisy, and the tiny model's prefill is too cheap for
a cache to show in TTFT.
"""

import json
import tempfile

import psutil
import pytest

from prefixcache.bench import live
from prefixcache.cli import build_parser

RUN_KEYS = {"label", "completed", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "hit_rate", "tier_hit_tokens"}


def bench(model_dir, *argv: str) -> dict:
    """Parse like the CLI does (``prefixcache bench offload ...``) and run, at the smallest useful sizes."""
    small = ["--model", str(model_dir), "--dtype", "float32", "--block-size", "4", "--output-len", "4"]
    small += ["--conversations", "6", "--turns", "3", "--user-len", "24", "--prompt-len", "40"]
    small += ["--disk-prompts", "4", "--redis-prompts", "3", "--disable-tqdm"]
    args = build_parser().parse_args(["bench", "offload", *small, *argv])
    return args.func(args)


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """The benchmark's temporary directories go here, so the test can see that they are removed."""
    directory = tmp_path / "tmp"
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    return directory


def children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


@pytest.mark.slow
def test_every_part_reports_tier_hits_and_leaves_nothing_behind(tiny_llama_dir, tmp_path, private_tmp, capsys):
    before = children()
    report = bench(tiny_llama_dir, "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"))
    assert children() <= before, "a server or redis-server outlived the benchmark"
    assert list(private_tmp.iterdir()) == []
    assert json.loads((tmp_path / "r.json").read_text()) == report
    assert (tmp_path / "r.png").stat().st_size > 0
    assert report["machine"]["cores"] >= 1 and report["config"]["model"] == tiny_llama_dir.name
    parts = report["parts"]
    assert set(parts) == {"host", "disk", "redis"}
    # redis-server is a required test component (.ci/run installs it): its absence fails here, by name
    assert "skipped" not in parts["redis"], parts["redis"]["skipped"]
    for name, runs in (("host", {"no_tier", "cpu_tier"}), ("disk", {"cold", "restart"}), ("redis", {"cold", "shared"})):
        assert set(parts[name]["runs"]) == runs
        for row in parts[name]["runs"].values():
            assert set(row) >= RUN_KEYS and row["failed"] == 0
        assert parts[name]["ttft_ratio"] > 0

    host = parts["host"]
    # 6 conversations of 3 turns: the final prompts are 3 x 24 + 2 x 4 = 80 tokens, the device a quarter of 480
    assert (host["working_set_tokens"], host["device_blocks"]) == (480, 30)
    assert host["runs"]["no_tier"]["completed"] == host["runs"]["cpu_tier"]["completed"] == 18
    assert host["runs"]["cpu_tier"]["hit_rate"] > host["runs"]["no_tier"]["hit_rate"]
    assert host["runs"]["cpu_tier"]["tier_hit_tokens"]["cpu"] > 0
    assert host["goal"] == 0.6

    disk = parts["disk"]
    assert disk["runs"]["cold"]["cached_tokens"] == 0
    assert disk["runs"]["restart"]["cached_tokens"] > 0 and disk["runs"]["restart"]["tier_hit_tokens"]["disk"] > 0
    assert disk["goal"] == 0.5

    redis = parts["redis"]
    assert redis["runs"]["cold"]["cached_tokens"] == 0
    assert redis["runs"]["shared"]["cached_tokens"] > 0 and redis["runs"]["shared"]["tier_hit_tokens"]["redis"] > 0

    out = capsys.readouterr().out
    assert "2 servers x 18 requests" in out and "device cache 30 blocks" in out and "goal <= 0.5" in out


def test_without_redis_server_the_redis_part_is_skipped_with_a_message(tiny_llama_dir, monkeypatch, capsys):
    monkeypatch.setattr(live.shutil, "which", lambda name: None)
    report = bench(tiny_llama_dir, "--parts", "redis")
    assert "redis-server not found" in report["parts"]["redis"]["skipped"]
    assert "redis: skipped" in capsys.readouterr().out


def test_bad_sizes_are_refused_before_any_server_starts(tiny_llama_dir):
    before = children()
    with pytest.raises(SystemExit, match="cannot hold the last turn"):
        bench(tiny_llama_dir, "--parts", "host", "--conversations", "1")
    with pytest.raises(SystemExit):
        bench(tiny_llama_dir, "--parts", "host,gpu")
    with pytest.raises(SystemExit):
        bench(tiny_llama_dir, "--device-fraction", "0")
    assert children() <= before
