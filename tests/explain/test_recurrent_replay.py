"""``explain`` on a model with recurrent layers: the replay drives the recurrent-state group with the engine's
checkpoint budget, so a prompt whose attention blocks are cached but whose part point has no state checkpoint
misses them as ``no_checkpoint`` (with what a checkpoint there would have saved), and on a tiny Qwen3.5 the
replay's hits are the live engine's ``num_cached_tokens``, request for request."""

import json
import random
import shutil

import httpx
import pytest

from prefixcache.cli import main
from prefixcache.core import FULL_ATTENTION, MISS_REASONS
from prefixcache.core.kv_cache_groups import RECURRENT_STATE
from prefixcache.engine import SamplingParams
from prefixcache.explain.analysis import ExplainConfig, explain
from prefixcache.explain.report import format_report, to_json
from tests.explain.conftest import decode_ids, prompts_of
from tests.model.conftest import write_checkpoint
from tests.server.harness import ServerProcess

BLOCK_SIZE = 16
HYBRID = (FULL_ATTENTION, RECURRENT_STATE)
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
# The engine's settings the live runs use and explain is given: prefill in chunks of 40 (inside blocks), 1200 KiB
# of which a quarter holds checkpoints (41 of the tiny Qwen3.5's states), sparse ones every 16 blocks.
ENGINE = {"kv_cache_memory": "1200KiB", "max_num_batched_tokens": 40, "block_size": BLOCK_SIZE}
EXPLAIN_FLAGS = ["--kv-cache-memory", "1200KiB", "--max-num-batched-tokens", "40", "--block-size", "16"]


def test_a_prompt_parting_where_no_checkpoint_lies_misses_its_cached_blocks_as_no_checkpoint():
    """A (100 tokens) leaves its finish checkpoint at 6 blocks; B shares 50 tokens: the attention groups hold 3
    blocks, but no checkpoint lies at 3, so B hits nothing and misses those 48 tokens as no_checkpoint (what a
    checkpoint there would have saved); B leaves a junction at 3, which C, parting at the same point, hits."""
    rng = random.Random(1)
    a = [rng.randrange(1000) for _ in range(100)]
    b = a[:50] + [rng.randrange(1000, 2000) for _ in range(10)]
    c = a[:50] + [rng.randrange(2000, 3000) for _ in range(20)]
    config = ExplainConfig(BLOCK_SIZE, 64 * BLOCK_SIZE, kv_cache_groups=HYBRID, num_checkpoint_slots=4)
    result = explain(prompts_of([a, b, c]), config, decode_ids)
    first, second, third = result.requests
    assert [r.capacity_hit for r in result.requests] == [0, 0, 48]
    assert (second.block_hit, second.checkpoint_would_save, second.reason) == (48, 48, "no_checkpoint")
    assert {k: v for k, v in second.missed.items() if v} == {"no_checkpoint": 48, "tail": 12}
    assert (first.checkpoint_would_save, third.checkpoint_would_save) == (0, 0)
    assert result.missed_by_core_reason == {
        "new": 96 + 16,
        "evicted": 0,
        "expired": 0,
        "evicted_below_retained": 0,
        "partial_block": 4 + 12 + 6,
        "skipped": 0,
        "no_checkpoint": 48,
    }
    assert set(result.missed_by_core_reason) == set(MISS_REASONS)
    assert result.checkpoint_would_save == 48
    assert result.checkpoint_hit_rate == pytest.approx((48 + 48) / 230)
    report = format_report(result, "log", [], 10)
    assert "no_checkpoint: a checkpoint would help" in report
    assert "(+48 tokens on 1 requests" in report
    assert to_json(result, "log", [])["requests"][1]["checkpoint_would_save"] == 48


def test_without_checkpoint_slots_every_cached_prefix_is_a_no_checkpoint_miss():
    """No budget (``--max-state-checkpoint-fraction 0``): nothing hits, and everything the attention groups held
    is counted as no_checkpoint."""
    a = list(range(100, 164))  # 4 blocks
    b = a[:40] + list(range(900, 920))
    config = ExplainConfig(BLOCK_SIZE, 64 * BLOCK_SIZE, kv_cache_groups=HYBRID, num_checkpoint_slots=0)
    result = explain(prompts_of([a, b]), config, decode_ids)
    assert [r.capacity_hit for r in result.requests] == [0, 0]
    assert result.requests[1].missed["no_checkpoint"] == 32


def test_a_recurrent_model_needs_the_replay():
    with pytest.raises(ValueError, match="give capacity_tokens"):
        ExplainConfig(BLOCK_SIZE, kv_cache_groups=HYBRID)
    with pytest.raises(ValueError, match="needs a recurrent-state group"):
        ExplainConfig(BLOCK_SIZE, 1024, num_checkpoint_slots=3)


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5")


@pytest.fixture(scope="module")
def config_only_dir(qwen35_dir, tmp_path_factory):
    """The checkpoint's config and tokenizer without its weights: all explain reads."""
    path = tmp_path_factory.mktemp("qwen3_5-config-only")
    for file in qwen35_dir.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, path / file.name)
    return path


@pytest.fixture(scope="module")
def qwen35(qwen35_dir):
    from prefixcache.model import load_model

    return load_model(str(qwen35_dir), dtype="float32")


def explain_json(tmp_path, qwen35_dir, bodies: list[dict], *flags: str) -> dict:
    log, out = tmp_path / "log.jsonl", tmp_path / "report.json"
    log.write_text("".join(json.dumps(body) + "\n" for body in bodies))
    main(["explain", str(log), "--model", str(qwen35_dir), "--dtype", "float32", *flags, "--json", str(out)])
    return json.loads(out.read_text())


DOCUMENT_RNG = random.Random(5)
DOCUMENT = [DOCUMENT_RNG.randrange(3, 500) for _ in range(300)]
# A document, then questions parting inside block 16 (the sparse checkpoint at 16 blocks), inside block 17 (sparse
# at 16 again: 16 tokens no_checkpoint; it leaves a junction at 17) and at 17 again (the junction).
QUESTIONS = [
    DOCUMENT + [7, 8, 9, 10, 11],
    DOCUMENT[:262] + [12, 13, 14, 15],
    DOCUMENT[:285] + [16, 17, 18],
    DOCUMENT[:285] + [19, 20, 21, 22, 23, 24],
]
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly and truthfully. " * 3}
# Two conversations sharing a long system message: without the hint at its end the second would hit nothing.
CHATS = [
    [SYSTEM, {"role": "user", "content": "The quick brown fox?"}],
    [SYSTEM, {"role": "user", "content": "Why cache prefixes?"}],
]


def test_the_replay_predicts_the_engines_hits_on_a_tiny_qwen35(make_llm, qwen35, config_only_dir, tmp_path, capsys):
    """From the config and tokenizer alone, the replay's hits are the engine's (see QUESTIONS)."""
    prompts = QUESTIONS
    llm = make_llm(loaded=qwen35, num_blocks=None, **ENGINE)
    served = [llm.generate([{"prompt_token_ids": p}], ONE_TOKEN, use_tqdm=False)[0].num_cached_tokens for p in prompts]
    assert served == [0, 256, 256, 272]
    plot = tmp_path / "split.png"
    report = explain_json(
        tmp_path, config_only_dir, [{"prompt": p} for p in prompts], *EXPLAIN_FLAGS, "--plot", str(plot)
    )
    assert [r["capacity_hit"] for r in report["requests"]] == served
    printed = capsys.readouterr().out
    assert "recurrent state: 41 checkpoint slots (sparse every 16 blocks" in printed
    assert "prefill in chunks of 40" in printed and plot.stat().st_size > 0
    assert [r["checkpoint_would_save"] for r in report["requests"]] == [0, 0, 16, 0]
    core = llm.engine.core
    assert report["config"]["num_checkpoint_slots"] == core.manager.state.num_checkpoint_slots == 41
    assert report["config"]["capacity_tokens"] == core.manager.num_blocks * BLOCK_SIZE
    assert report["missed_tokens"]["no_checkpoint"] == core.manager.stats.missed_tokens["no_checkpoint"] == 16


def test_a_chats_message_ends_are_checkpoint_hints_in_the_replay_as_in_the_engine(
    make_llm, qwen35, qwen35_dir, tmp_path
):
    """The second conversation hits the first's hint checkpoint at the block boundary before the system message
    ends, in the engine and in the replay (which places the hints through the same render)."""
    llm = make_llm(loaded=qwen35, num_blocks=None, **ENGINE)
    served = [llm.chat(chat, ONE_TOKEN, use_tqdm=False)[0].num_cached_tokens for chat in CHATS]
    assert served[1] > 0 and served[1] % BLOCK_SIZE == 0
    report = explain_json(tmp_path, qwen35_dir, [{"messages": chat} for chat in CHATS], *EXPLAIN_FLAGS)
    assert [r["capacity_hit"] for r in report["requests"]] == served


def test_explain_replays_a_hybrid_servers_checkpoints_hit_for_hit(qwen35_dir, tmp_path):
    """``--base-url``: the server's KV cache groups, its checkpoint budget (/v1/cache/config) and a chat's
    checkpoint hints (/v1/cache/lookup) make the replay's hits the server's own."""
    serve_args = ["--block-size", "16", "--kv-cache-memory", "1200KiB", "--max-num-batched-tokens", "40"]
    server = ServerProcess(qwen35_dir, [*serve_args, "--dtype", "float32"], tmp_path / "serve.log")
    bodies = [{"prompt": p} for p in QUESTIONS] + [{"messages": chat} for chat in CHATS]
    try:
        server.wait_ready()
        served = []
        for body in bodies:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            response = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 1, "temperature": 0}, timeout=60)
            assert response.status_code == 200, response.text
            served.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        config = httpx.get(f"{server.url}/v1/cache/config").json()
        log, out = tmp_path / "log.jsonl", tmp_path / "report.json"
        log.write_text("".join(json.dumps(body) + "\n" for body in bodies))
        main(["explain", str(log), "--base-url", server.url, "--json", str(out)])  # the server's blocks: its capacity
        capacity = str(108 * BLOCK_SIZE)  # the server's blocks in 1200 KiB (tests/engine/test_cache_layout.py)
        given = tmp_path / "given.json"
        main(["explain", str(log), "--base-url", server.url, "--capacity-tokens", capacity, "--json", str(given)])
    finally:
        server.stop()
    assert config["recurrent_state"] == {"num_state_slots": 64, "num_checkpoint_slots": 41, "sparse_every_blocks": 16,
                     "max_num_batched_tokens": 40}  # fmt: skip
    assert served[:4] == [0, 256, 256, 272] and served[5] > 0
    assert config["num_blocks"] == 108
    report = json.loads(out.read_text())
    assert [r["capacity_hit"] for r in report["requests"]] == served
    assert report["missed_tokens"]["no_checkpoint"] == 16
    assert json.loads(given.read_text())["requests"] == report["requests"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-cache-memory", "lots"], "cannot read memory size 'lots'"),
        (["--kv-cache-memory", "300KiB"], "fewer than 2 KV blocks"),  # the states alone take more
        (["--max-state-checkpoint-fraction", "1.5"], "max_state_checkpoint_fraction must be in [0, 1)"),
        (["--base-url", "http://127.0.0.1:9", "--kv-cache-memory", "1GiB"], "a server's cache is its own"),
    ],
)
def test_a_bad_cache_setting_is_a_one_line_usage_error(tmp_path, config_only_dir, capsys, flags, message):
    log = tmp_path / "requests.jsonl"
    log.write_text(json.dumps({"prompt": [1, 2, 3]}) + "\n")
    model = [] if "--base-url" in flags else ["--model", str(config_only_dir)]
    with pytest.raises(SystemExit):
        main(["explain", str(log), *model, *flags])
    assert message in capsys.readouterr().err
