"""``prefixcache bench serve`` against a real tiny-model server: sane numbers, vLLM's JSON keys, a plot."""

import argparse
import json

import pytest

from prefixcache.bench import serve as bench_serve
from tests.server.harness import ServerProcess

VLLM_KEYS = {f"{stat}_{metric}_ms" for stat in ("mean", "median", "p99") for metric in ("ttft", "tpot", "itl")} | {
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "completed",
    "duration",
}
OUR_KEYS = {"hit_rate", "shared_fraction", "label"}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    args = ["--block-size", "4", "--num-blocks", "1024", "--enable-reset-prefix-cache", "--disable-uvicorn-access-log"]
    process = ServerProcess(tiny_llama_dir, args, tmp_path_factory.mktemp("bench-server") / "server.log")
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def run(*argv: str):
    """Parse like the CLI does (``prefixcache bench serve ...``) and run."""
    parser = argparse.ArgumentParser()
    bench_serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", *argv, "--disable-tqdm"])
    return args.func(args)


def workload(server, num_prompts: int = 6) -> list[str]:
    return ["--base-url", server.url, "--num-prompts", str(num_prompts), "--input-len", "48", "--output-len", "6"]


def assert_sane(row: dict, num_prompts: int = 6) -> None:
    assert set(row) >= VLLM_KEYS | OUR_KEYS
    assert (row["completed"], row["failed"]) == (num_prompts, 0)
    assert 0 < row["median_ttft_ms"] <= row["p99_ttft_ms"]
    assert row["mean_tpot_ms"] > 0 and 0 < row["mean_itl_ms"] <= row["p99_itl_ms"]
    assert row["output_throughput"] == pytest.approx(num_prompts * 6 / row["duration"])
    assert row["total_token_throughput"] == pytest.approx(num_prompts * (48 + 6) / row["duration"])
    assert row["request_throughput"] == pytest.approx(num_prompts / row["duration"])


def test_single_run_reports_the_server_hit_rate(server, tmp_path):
    path = tmp_path / "run.json"
    run(*workload(server), "--prefix-len", "24", "--request-rate", "50", "--json", str(path))
    row = json.loads(path.read_text())
    assert_sane(row)
    assert row["shared_fraction"] == 0.5
    # The first request computes the 24 shared tokens (6 blocks); the 5 others find them cached.
    assert row["hit_rate"] == pytest.approx(5 * 24 / (6 * 48))


def test_sweep_writes_a_list_and_a_plot(server, tmp_path):
    path, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    run(*workload(server, 4), "--sweep-shared-fractions", "0,0.5", "--label", "ours", "--json", str(path))
    rows = json.loads(path.read_text())
    assert [r["shared_fraction"] for r in rows] == [0.0, 0.5]
    for row in rows:
        assert_sane(row, 4)
        assert row["label"] == "ours"
        assert row["cache_reset"] is True
    assert rows[0]["hit_rate"] == 0
    assert rows[1]["hit_rate"] == pytest.approx(3 * 24 / (4 * 48))

    other = tmp_path / "vllm.json"
    other.write_text(json.dumps([{**r, "label": "vllm", "mean_ttft_ms": 2 * r["mean_ttft_ms"]} for r in rows]))
    run("--results", str(path), str(other), "--plot", str(png))
    assert png.read_bytes().startswith(b"\x89PNG")


def test_needs_a_server_or_results():
    with pytest.raises(SystemExit, match="--base-url"):
        run()
