"""``prefixcache bench decode``: its options, the offline points on a tiny model and the report built from them."""

from __future__ import annotations

import pytest

from prefixcache.bench.decode import (
    DecodePoint,
    StreamPoint,
    build_report,
    format_report,
    measure_bandwidth,
    run_offline,
    stream_label,
    weight_bytes_read,
)
from prefixcache.cli import build_parser
from prefixcache.config import EngineConfig


def test_options_parse_batch_sizes_and_engines() -> None:
    args = build_parser().parse_args(["bench", "decode", "--batch-sizes", "16,1,4", "--quantization", "gguf"])
    assert args.batch_sizes == [1, 4, 16] and args.quantization == ["gguf"]
    assert build_parser().parse_args(["bench", "decode"]).quantization == ["none", "gguf"]
    assert build_parser().parse_args(["bench", "decode"]).modes == ["eager"]
    assert build_parser().parse_args(["bench", "decode", "--modes", "compiled,eager"]).modes == ["compiled", "eager"]


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--batch-sizes", "1,0"), ("--batch-sizes", "x"), ("--quantization", "awq"), ("--modes", "cudagraphs")],
)
def test_bad_options_are_refused(flag: str, value: str, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "decode", flag, value])
    assert flag.removeprefix("--").split("-")[0] in capsys.readouterr().err


def test_offline_points_count_decode_steps_only(tiny_llama_dir, tiny_loaded) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="8MiB", max_num_seqs=3)
    points = run_offline({"tiny": config}, [1, 3], prompt_len=5, output_len=6, rounds=2)
    assert [(p.engine, p.batch) for p in points] == [("tiny", 1), ("tiny", 3)]
    # the first token comes with the prefill; the other five are decode steps
    assert [p.steps for p in points] == [5, 5]
    assert all(len(p.rounds_ms) == 2 and p.ms_per_step == pytest.approx(min(p.rounds_ms), abs=1e-3) for p in points)
    weights = weight_bytes_read(tiny_loaded.model)
    # float32 untied: every matrix but the embedding (a few rows of it are read); K/V at the mean context
    hidden, vocab = tiny_loaded.config.hidden_size, tiny_loaded.config.vocab_size
    assert weights == sum(p.numel() * 4 for p in tiny_loaded.model.parameters()) - vocab * hidden * 4
    assert points[1].bytes_per_step > points[0].bytes_per_step > weights


def test_report_gives_each_point_its_bandwidth_limit() -> None:
    offline = [DecodePoint("prefixcache gguf", 4, steps=10, seconds=0.05, bytes_per_step=20_000_000)]
    streams = [
        StreamPoint("llama.cpp server", 80.0, [75.0, 80.0]),
        StreamPoint("prefixcache serve (gguf)", 36.0, [36.0, 27.0]),
        StreamPoint("prefixcache offline (gguf)", 40.0, [40.0, 30.0]),
    ]
    settings = dict(
        model="m", dtype="bfloat16", device="cpu", threads=2, prompt_len=64, output_len=11, rounds=2, batch_sizes=[4]
    )
    report = build_report(offline, streams, bandwidth=10e9, settings=settings, notes=["a note"])
    (row,) = report["offline"]
    assert row["ms_per_step"] == 5.0 and row["tokens_per_s"] == 800.0
    assert row["limit_ms_per_step"] == 2.0 and row["bandwidth_fraction"] == 0.4  # 20 MB at 10 GB/s
    text = format_report(report)
    assert "| prefixcache gguf | 4 | 5.00 | 800.0 | 20.0 | 2.00 | 0.40 |" in text
    assert "| llama.cpp server | 80.0 | 75.0, 80.0 |" in text and "note: a note" in text
    assert "memory bandwidth (tensor copy on cpu): 10.0 GB/s" in text
    # the server path's cost: each round's served rate over the offline one of the same round
    assert "| prefixcache serve (gguf) | 36.0 | 36.0, 27.0 | 0.90, 0.90; median 0.90 |" in text
    assert "| prefixcache offline (gguf) | 40.0 | 40.0, 30.0 |  |" in text


def test_a_compiled_stream_is_labelled_apart_and_pairs_with_its_offline_run() -> None:
    eager, compiled = (EngineConfig(quantization="gguf", enforce_eager=e) for e in (True, False))
    assert stream_label("serve", eager) == "prefixcache serve (gguf)"
    assert stream_label("serve", compiled) == "prefixcache serve (gguf compiled)"
    streams = [
        StreamPoint(stream_label("serve", compiled), 45.0, [45.0]),
        StreamPoint(stream_label("offline", compiled), 50.0, [50.0]),
        StreamPoint(stream_label("serve", eager), 20.0, [20.0]),
        StreamPoint(stream_label("offline", eager), 40.0, [40.0]),
    ]
    settings = dict(
        model="m", dtype="bfloat16", device="cpu", threads=1, prompt_len=8, output_len=8, rounds=1, batch_sizes=[1]
    )
    text = format_report(build_report([], streams, bandwidth=10e9, settings=settings))
    assert "| prefixcache serve (gguf compiled) | 45.0 | 45.0 | 0.90; median 0.90 |" in text
    assert "| prefixcache serve (gguf) | 20.0 | 20.0 | 0.50; median 0.50 |" in text


def test_bandwidth_is_measured() -> None:
    assert measure_bandwidth(num_bytes=8 * 2**20, repeats=2) > 1e8  # any machine copies 100 MB/s
