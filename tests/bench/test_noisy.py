"""``prefixcache bench noisy-neighbour`` end to end on the tiny model: three runs on a live server per scheduling
policy, the report's shape, and cache_control keeping at least what plain LRU keeps of A's prefix.

Timings are not asserted: the machine is shared and noisy, and the tiny model's prefill is too cheap for a cache
to show in TTFT.
"""

import json

import psutil
import pytest

from prefixcache.cli import build_parser

SUMMARY_KEYS = {"completed", "failed", "hit_rate", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms"}


def bench(model_dir, *argv: str) -> dict:
    """Parse like the CLI does (``prefixcache bench noisy-neighbour ...``) and run at the smallest useful sizes:
    blocks of 4 tokens, a 64-token system prompt, B's prompts of 32 tokens."""
    small = ["--model", str(model_dir), "--dtype", "float32", "--block-size", "4", "--output-len", "4"]
    small += ["--system-len", "64", "--question-len", "8", "--flood-len", "32", "--a-requests", "4"]
    # Two running at once: B's running requests (9 blocks each) and one of A's (20) fit in the 36 blocks beside
    # each other, so what A keeps depends on the eviction order of free blocks, not on who is running.
    small += ["--a-rate", "4", "--max-num-seqs", "2", "--disable-tqdm"]
    args = build_parser().parse_args(["bench", "noisy-neighbour", *small, *argv])
    return args.func(args)


def children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


@pytest.mark.slow
def test_three_runs_report_a_and_b_and_cache_control_keeps_at_least_what_lru_keeps(tiny_llama_dir, tmp_path, capsys):
    before = children()
    report = bench(tiny_llama_dir, "--json", str(tmp_path / "r.json"))
    assert children() <= before, "the server outlived the benchmark"
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(json.dumps(report))

    config = report["config"]
    # 16 flood prompts of 32 + 4 tokens = 9 blocks each; a quarter of the 144 blocks
    assert (config["flood_requests"], config["cache_blocks"], config["cache_share_of_flood"]) == (16, 36, 0.25)
    assert config["cache_control_priority"] == 80
    assert report["machine"]["cores"] >= 1 and len(report["machine"]["load_average_before"]) == 3

    assert list(report["policies"]) == ["fcfs", "cache-aware"]
    for result in report["policies"].values():
        runs = result["runs"]
        assert list(runs) == ["alone", "lru", "cache_control"]
        for name, row in runs.items():
            assert set(row["A"]) >= SUMMARY_KEYS and row["A"]["completed"] == 4 and row["A"]["failed"] == 0
            if name == "alone":
                assert row["B"] is None
            else:
                assert set(row["B"]) >= SUMMARY_KEYS and row["B"]["completed"] == 16
                assert row["B"]["hit_rate"] == 0.0  # unique prompts, salted apart from A's
        assert runs["alone"]["A"]["hit_rate"] > 0  # every question after the first reads the system prompt
        assert runs["cache_control"]["A"]["hit_rate"] >= runs["lru"]["A"]["hit_rate"]

        for name in ("lru", "cache_control"):
            ratios = result["ratios"][name]
            assert ratios["hit_rate_ratio"] == runs[name]["A"]["hit_rate"] / runs["alone"]["A"]["hit_rate"]
            assert ratios["ttft_ratio"] == runs[name]["A"]["mean_ttft_ms"] / runs["alone"]["A"]["mean_ttft_ms"]
        assert result["goals"] == {"hit_rate_ratio_at_least": 0.95, "ttft_ratio_at_most": 1.2}
        assert result["hit_rate_goal_met"] == (result["ratios"]["cache_control"]["hit_rate_ratio"] >= 0.95)
    policies = report["policies"]
    assert report["flood_throughput_ratio"] == {
        name: policies["cache-aware"]["runs"][name]["B"]["request_throughput"]
        / policies["fcfs"]["runs"][name]["B"]["request_throughput"]
        for name in ("lru", "cache_control")
    }

    out = capsys.readouterr().out
    assert "--num-gpu-blocks-override 36" in out and "holds 0.25 of B's flood" in out
    assert "A + flood, plain LRU" in out and "cache-aware: goals with cache_control" in out
    assert "B's throughput with cache-aware over fcfs" in out


def test_a_cache_too_small_for_one_request_of_each_is_refused_before_the_server_starts(tiny_llama_dir):
    before = children()
    with pytest.raises(SystemExit, match="cannot hold one of A's requests"):
        bench(tiny_llama_dir, "--a-requests", "1")
    with pytest.raises(SystemExit):
        bench(tiny_llama_dir, "--cache-fraction", "0")
    with pytest.raises(SystemExit):
        bench(tiny_llama_dir, "--scheduling-policy", "lpm")
    assert children() <= before


def test_random_weights_write_a_small_llama_with_the_models_tokenizer_and_chat_template(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    from prefixcache.bench.noisy import random_checkpoint
    from prefixcache.model.loader import read_config

    source = read_config(tiny_llama_dir)
    out = random_checkpoint(tiny_llama_dir, source.vocab_size, tmp_path / "model", seed=0)
    config = read_config(out)
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (2, 64, source.vocab_size)
    assert config.max_position_embeddings >= 2048 + 1024  # the system prompt and more
    ours, theirs = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tiny_llama_dir)
    chat = [{"role": "system", "content": "Prefix caching reuses"}, {"role": "user", "content": "the keys?"}]
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat)
    assert ours.eos_token_id == theirs.eos_token_id == config.eos_token_ids[0]
