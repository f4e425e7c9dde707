"""``prefixcache bench serve`` against a real tiny-model server: sane numbers, vLLM's JSON keys, a plot."""

import argparse
import asyncio
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


def test_rounds_alternate_the_sweep_order():
    assert bench_serve.sweep_order(3, 3) == [(0, 0), (0, 1), (0, 2), (1, 2), (1, 1), (1, 0), (2, 0), (2, 1), (2, 2)]


def test_servers_measured_one_after_another_get_the_same_requests(server, tmp_path):
    """What ``serve-compare`` relies on: a sweep's requests depend only on the seed and the vocabulary."""
    import asyncio

    parser = argparse.ArgumentParser()
    bench_serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", *workload(server, 3), "--sweep-shared-fractions", "0,0.5", "--disable-tqdm"])
    rows = [row for label in "ab" for row in asyncio.run(bench_serve.benchmark_server(args, label, server.url, {}))]
    assert [(r["label"], r["shared_fraction"]) for r in rows] == [("a", 0.0), ("a", 0.5), ("b", 0.0), ("b", 0.5)]
    for r in rows:
        assert_sane(r, 3)
    # The same prompts for both, and the cache reset before each: the same hit rate on each.
    assert rows[1]["hit_rate"] == rows[3]["hit_rate"] == pytest.approx(2 * 24 / (3 * 48))


def row(fraction: float, ttft_ms: float, hit_rate: float) -> dict:
    return {"shared_fraction": fraction, "mean_ttft_ms": ttft_ms, "hit_rate": hit_rate, "completed": 10}


def test_a_ttft_speedup_above_the_prefill_ceiling_is_a_measurement_error():
    rows = [row(0.0, 5000.0, 0.0), row(0.5, 3000.0, 0.5), row(0.8, 700.0, 0.77)]
    bench_serve.check_ceilings(rows)
    assert rows[0]["ttft_speedup"] is None  # the reference itself
    assert rows[1]["ttft_speedup"] == pytest.approx(5000 / 3000) and rows[1]["ttft_ceiling"] == pytest.approx(2)
    assert rows[1]["measurement_error"] is False
    assert rows[2]["measurement_error"] is True  # 7.1x against a ceiling of 4.3x: the unshared point queued


def test_rounds_measure_every_point_in_both_orders(server, tmp_path, capsys):
    path = tmp_path / "sweep.json"
    run(*workload(server, 3), "--sweep-shared-fractions", "0,0.5", "--rounds", "2", "--json", str(path))
    rows = json.loads(path.read_text())
    for point in rows:
        assert (point["rounds"], point["completed"], len(point["mean_ttft_ms_by_round"])) == (2, 6, 2)
        assert point["cache_reset"] is True
    assert rows[1]["hit_rate"] == pytest.approx(2 * 24 / (3 * 48))  # each round starts from an empty cache
    assert rows[1]["measurement_error"] == (rows[1]["ttft_speedup"] > rows[1]["ttft_ceiling"])
    assert "mean TTFT by round" in capsys.readouterr().out


def test_the_streaming_client_never_queues_requests_itself():
    """A sweep point sends all its requests at once; the client must open a connection for each (aiohttp's
    default pool holds 100), or requests wait in the client and the server's TTFT looks longer than it is."""
    count = 150

    async def main() -> list[int]:
        connected = 0
        everyone = asyncio.Event()

        async def answer_when_all_are_connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connected
            await reader.readuntil(b"\r\n\r\n")
            connected += 1
            if connected == count:
                everyone.set()
            await everyone.wait()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
            await writer.drain()
            writer.close()

        listener = await asyncio.start_server(answer_when_all_are_connected, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}/"
        try:
            async with bench_serve.streaming_client(60) as client:
                responses = await asyncio.wait_for(asyncio.gather(*(client.get(url) for _ in range(count))), 60)
        finally:
            listener.close()
        return [response.status_code for response in responses]

    assert asyncio.run(main()) == [200] * count
