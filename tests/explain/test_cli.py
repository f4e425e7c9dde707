"""``prefixcache explain`` end to end on the tiny checkpoint's tokenizer: the report, --json and --plot."""

import json
import random

import pytest

from prefixcache.cli import main
from prefixcache.engine.chat_breakpoints import chat_token_ids
from prefixcache.explain.log import Prompt
from tests.helpers import build_tokenizer

SYSTEM = "Current time: 14:{minute:02d}:{second:02d}. You are a helpful assistant. Answer briefly and truthfully."
QUESTIONS = ["The quick brown fox?", "Why cache prefixes?", "Name a lazy dog."]


def chat_body(i: int, rng: random.Random) -> dict:
    system = SYSTEM.format(minute=10 + i, second=rng.randrange(60))
    return {
        "model": "tiny",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[i % 3]}],
    }


def stamped_log(path, num_requests: int = 24, bad_lines=()) -> list[dict]:
    rng = random.Random(0)
    bodies = [chat_body(i, rng) for i in range(num_requests)]
    lines = [json.dumps(b) for b in bodies]
    for position, text in bad_lines:
        lines.insert(position - 1, text)
    path.write_text("\n".join(lines) + "\n")
    return bodies


def token_after(tokenizer, body: dict, text: str) -> int:
    """Index of the first token after ``text`` in the templated prompt."""
    ids = chat_token_ids(tokenizer, body["messages"])
    return next(k for k in range(len(ids)) if tokenizer.decode(ids[:k]).endswith(text))


def test_the_report_names_the_timestamp_its_position_and_the_fix(tmp_path, tiny_llama_dir, capsys):
    log = tmp_path / "requests.jsonl"
    bodies = stamped_log(log, bad_lines=[(3, "{oops"), (9, json.dumps({"prompt": ""}))])
    position = token_after(build_tokenizer(), bodies[0], "Current time: 14:")
    out_json, out_png = tmp_path / "report.json", tmp_path / "report.png"
    main(["explain", str(log), "--model", str(tiny_llama_dir), "--window", "24", "--json", str(out_json),
          "--plot", str(out_png), "--capacity-tokens", "4096"])  # fmt: skip
    printed = capsys.readouterr().out
    report = json.loads(out_json.read_text())
    divergence = report["divergence"]
    # Minutes 10..33: a request parts at the first minute digit from those of another decade, else at the second.
    assert (divergence["start"], divergence["end"]) == (position, position + 1)
    assert divergence["count"] == divergence["total"] == 23
    assert divergence["kind"] == "varying"
    assert divergence["shared_text"].endswith("Current time: 14:")  # the whole "MM:SS" moves
    assert divergence["varying_span"] == [position, position + 5]
    assert divergence["varying_text"] == divergence["this_text"][:5] and divergence["prompts_rewritten"] == 24
    assert divergence["fixed_block_hit_rate"] > 2 * report["hit_rate"]["infinite_blocks"]
    assert f"100% of divergences (23 of 23) start at tokens {position}–{position + 1}" in printed
    assert "Current time: 14:" in printed and "move what changes after what stays" in printed
    assert f"hit rate {divergence['fixed_block_hit_rate']:.3f} at 16-token blocks" in printed
    assert report["num_requests"] == 24 and report["missed_tokens"]["evicted"] == 0
    assert [e["line"] for e in report["errors"]] == [3, 9]
    assert "line 3: not JSON" in printed and "line 9: the prompt is empty" in printed
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_moving_the_reported_span_gives_the_reported_hit_rate(tmp_path, tiny_llama_dir, capsys):
    """The rate is computed on the rewritten prompts: moving the same tokens by hand gives the same number."""
    from prefixcache.explain.analysis import block_hit_rate

    log = tmp_path / "requests.jsonl"
    bodies = stamped_log(log, num_requests=9)
    out_json = tmp_path / "report.json"
    main(["explain", str(log), "--model", str(tiny_llama_dir), "--json", str(out_json)])
    report = json.loads(out_json.read_text())
    start = report["divergence"]["varying_span"][0]
    tokenizer = build_tokenizer()
    moved = []
    for line, body in enumerate(bodies, start=1):
        ids = chat_token_ids(tokenizer, body["messages"])
        end = token_after(tokenizer, body, body["messages"][0]["content"][: len("Current time: 14:00:00")])
        moved.append(Prompt(line, ids[:start] + ids[end:] + ids[start:end]))
    assert report["divergence"]["fixed_block_hit_rate"] == pytest.approx(block_hit_rate(moved, 16))


def test_a_log_without_a_usable_line_exits_with_the_reasons(tmp_path, tiny_llama_dir, capsys):
    log = tmp_path / "bad.jsonl"
    log.write_text("nope\n" + json.dumps({"prompt_token_ids": []}) + "\n")
    with pytest.raises(SystemExit, match="no usable request"):
        main(["explain", str(log), "--model", str(tiny_llama_dir)])
    printed = capsys.readouterr().out
    assert "line 1: not JSON" in printed and "line 2: prompt_token_ids must be" in printed


def test_a_prompt_larger_than_the_capacity_is_a_usage_error(tmp_path, tiny_llama_dir, capsys):
    log = tmp_path / "requests.jsonl"
    stamped_log(log, num_requests=2)
    with pytest.raises(SystemExit):
        main(["explain", str(log), "--model", str(tiny_llama_dir), "--capacity-tokens", "16"])
    assert "more than the capacity" in capsys.readouterr().err


HOSTILE = [
    '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",  # RecursionError in the JSON parser
    json.dumps({"prompt_token_ids": [1, 2**63]}),  # OverflowError in the analysis
    '{"prompt": "lone \\ud800 surrogate"}',  # TypeError in the tokenizer
    json.dumps({"prompt_token_ids": [5, 100_000]}),  # outside the tiny model's vocabulary of 512
]


def test_hostile_lines_are_skipped_and_counted_and_the_report_survives(tmp_path, tiny_llama_dir, capsys):
    log = tmp_path / "requests.jsonl"
    stamped_log(log, num_requests=6, bad_lines=[(2 + 2 * k, text) for k, text in enumerate(HOSTILE)])
    out_json = tmp_path / "report.json"
    main(["explain", str(log), "--model", str(tiny_llama_dir), "--json", str(out_json)])
    printed = capsys.readouterr().out
    report = json.loads(out_json.read_text())
    assert report["num_requests"] == 6 and "(4 bad lines skipped)" in printed
    assert [(e["line"], e["message"].split(":")[0]) for e in report["errors"]] == [
        (2, "JSON nested too deeply to read"),
        (4, "prompt_token_ids must be a non-empty list of token ids (integers in [0, 2^63))"),
        (6, "prompt"),
        (8, "prompt token ids must be in [0, 512)"),
    ]
    assert "line 6: prompt: invalid Unicode: a lone surrogate" in printed


def test_the_report_shows_the_span_in_its_text_and_its_message(tmp_path, tiny_llama_dir, capsys):
    log = tmp_path / "requests.jsonl"
    stamped_log(log, num_requests=6)
    main(["explain", str(log), "--model", str(tiny_llama_dir), "--window", "16"])
    printed = capsys.readouterr().out
    assert "in message 1 of 2 (system) of line" in printed
    example = next(line for line in printed.splitlines() if "⟦" in line and "marks" not in line)
    assert "Current time: 14:" in example and "⟧" in example and ". You are a" in example


def test_an_output_path_that_cannot_be_written_is_one_line_before_any_work(tmp_path, tiny_llama_dir, capsys):
    log = tmp_path / "requests.jsonl"
    stamped_log(log, num_requests=2)
    for flag in ("--json", "--plot"):
        with pytest.raises(SystemExit):
            main(["explain", str(log), "--model", str(tiny_llama_dir), flag, str(tmp_path / "missing" / "out")])
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is not a directory" in err


def test_breakpoint_what_if_reports_both_rates_from_one_replay(tmp_path, tiny_llama_dir, capsys):
    """A shared system prompt, chats behind it and completions (no system message) flooding a small cache."""
    system = "You are a helpful assistant. " * 6
    flood = [{"prompt": f"unrelated text number {i} " * 12} for i in range(6)]
    chats = [{"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]} for q in QUESTIONS]
    log = tmp_path / "requests.jsonl"
    bodies = [b for pair in zip(chats, flood[::2], flood[1::2], strict=True) for b in pair]
    log.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    out_json = tmp_path / "report.json"
    main(["explain", str(log), "--model", str(tiny_llama_dir), "--capacity-tokens", "256", "--block-size", "4",
          "--breakpoint", "system:1h", "--json", str(out_json)])  # fmt: skip
    printed = capsys.readouterr().out
    report = json.loads(out_json.read_text())
    assert report["breakpoint_requests"] == 3 and report["directed_requests"] == 0 and not report["timed"]
    rates = report["hit_rate"]
    assert rates["with_breakpoint"] > rates["capacity"]
    assert f"{rates['with_breakpoint']:10.3f}" in printed and "a 1h breakpoint after the system messages" in printed
    assert "no time passes and no TTL ends" in printed


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--breakpoint", "system"], "give --capacity-tokens or --kv-cache-memory too"),
        (["--breakpoint", "middle", "--capacity-tokens", "64"], "WHERE is 'system' or a number of tokens"),
        (["--breakpoint", "64:2h", "--capacity-tokens", "64"], "ttl is one of 5m, 1h"),
    ],
)
def test_a_bad_breakpoint_is_a_one_line_usage_error(tmp_path, tiny_llama_dir, capsys, flags, message):
    log = tmp_path / "requests.jsonl"
    log.write_text(json.dumps({"prompt": [1, 2, 3]}) + "\n")
    with pytest.raises(SystemExit):
        main(["explain", str(log), "--model", str(tiny_llama_dir), *flags])
    assert message in capsys.readouterr().err


def test_kv_cache_memory_replays_through_the_blocks_serve_would_have(tmp_path, tiny_llama_dir, make_llm):
    """The tiny Llama in 64 KiB of float32: the engine's 8 blocks of 16 tokens (2 layers x K and V x 2 heads x 16
    x 4 bytes = 8 KiB a block) are the replay's capacity."""
    log, out = tmp_path / "requests.jsonl", tmp_path / "report.json"
    stamped_log(log, num_requests=3)
    main(["explain", str(log), "--model", str(tiny_llama_dir), "--kv-cache-memory", "64KiB", "--dtype", "float32",
          "--json", str(out)])  # fmt: skip
    engine = make_llm(kv_cache_memory="64KiB", num_blocks=None, block_size=16).engine.core.manager
    assert json.loads(out.read_text())["config"]["capacity_tokens"] == engine.num_blocks * 16 == 128
