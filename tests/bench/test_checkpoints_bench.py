"""``prefixcache bench checkpoints``: every model on the same token ids within the same memory, and the goal."""

import json

from prefixcache.bench.checkpoints import WORKLOADS, CheckpointBenchConfig, models, run
from prefixcache.cli import build_parser


def test_models_share_the_memory_and_checkpoints_stay_within_their_fraction():
    config = CheckpointBenchConfig()
    rows = models(config)
    memory = 2 * 2**30
    hybrid = rows["hybrid, every rule"]
    assert hybrid["num_checkpoint_slots"] * config.state_bytes <= 0.25 * memory
    used = (hybrid["num_checkpoint_slots"] + hybrid["num_state_slots"]) * config.state_bytes
    used += hybrid["num_blocks"] * config.block_bytes(config.num_full_layers, config.block_size)
    assert memory - config.block_bytes(config.num_full_layers, config.block_size) < used <= memory
    assert rows["full attention"]["num_blocks"] * config.block_bytes(config.num_layers, 16) <= memory
    # Qwen3.5-0.8B-like: 18 linear layers of (16 x 128 x 128 + 6,144 x 3) float32 values.
    assert config.state_bytes == 18 * (16 * 128 * 128 + 6144 * 3) * 4


def test_the_hybrid_reaches_nine_tenths_of_full_attention_and_aligned_is_printed_beside(tmp_path, capsys):
    report = run(CheckpointBenchConfig(), tmp_path / "checkpoints.json")
    assert json.loads((tmp_path / "checkpoints.json").read_text()) == json.loads(json.dumps(report))
    for workload in WORKLOADS:
        results = report["results"][workload]
        assert results["hybrid, every rule"]["hit_rate"] >= 0.9 * results["full attention"]["hit_rate"], workload
        assert results["hybrid, every rule"]["hit_rate"] >= results["aligned (vLLM-style)"]["hit_rate"]
    # The rules are measured apart: without the finish rule a conversation's next turn finds nothing.
    chat = report["results"]["chat"]
    assert chat["  without finish"]["hit_rate"] < 0.5 * chat["hybrid, every rule"]["hit_rate"]
    assert chat["hybrid, every rule"]["checkpoints"]["hits"]["finish"] == 8 * 5
    assert "aligned (vLLM-style)" in capsys.readouterr().out


def test_cli_parses():
    args = build_parser().parse_args(["bench", "checkpoints", "--kv-cache-memory", "1GiB"])
    assert args.kv_cache_memory == "1GiB"
