"""``prefixcache bench hybrid`` on a small shape: both layouts measured in one run, the ratios taken from them."""

import json

from prefixcache.bench.hybrid import HybridBenchConfig, run
from prefixcache.cli import build_parser

SMALL = HybridBenchConfig(
    sliding_window=64,
    prompt_tokens=512,
    memory_output_tokens=24,
    num_long_requests=5,
    document_tokens=256,
    num_questions=4,
    question_tokens=8,
    answer_tokens=4,
    max_num_batched_tokens=128,
    kv_cache_memory="2MiB",
)


def test_the_report_holds_both_layouts_and_their_ratios(tmp_path, capsys):
    report = run(SMALL, tmp_path / "hybrid.json")
    assert json.loads((tmp_path / "hybrid.json").read_text()) == json.loads(json.dumps(report))
    mask, hybrid, ratio = report["mask-only"], report["hybrid"], report["hybrid_over_mask_only"]
    assert report["kv_cache_groups"] == [[64, 1]] * 5 + [[None, 1]]
    # A 512-token request: 32 blocks of 6 layers against 32 + 5 x 6 one-layer blocks (window 64, block 16).
    block = 16 * 2 * 32 * 4  # one layer's K and V of a block, float32
    assert mask["memory"]["decode_bytes"] == 33 * 6 * block  # the first decode token opened block 32
    assert hybrid["memory"]["decode_bytes"] == (33 + 5 * 5) * block
    assert ratio["decode_bytes"] == hybrid["memory"]["decode_bytes"] / mask["memory"]["decode_bytes"]
    assert hybrid["concurrency"]["max_running"] > mask["concurrency"]["max_running"]
    assert ratio["hit_rate_equal"] and ratio["outputs_identical"]
    # The first question computes the document; the other three reuse all of it (16 whole blocks).
    assert hybrid["shared_document"]["hits"] == mask["shared_document"]["hits"] == 3 * 256
    assert "hybrid/mask" in capsys.readouterr().out


def test_the_command_is_registered_with_the_other_benchmarks():
    args = build_parser().parse_args(["bench", "hybrid", "--prompt-tokens", "1024", "--kv-cache-memory", "8MiB"])
    assert (args.prompt_tokens, args.kv_cache_memory, args.num_questions) == (1024, "8MiB", 32)
