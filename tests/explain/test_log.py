"""Reading request logs: every body shape the server takes, and bad lines reported by number, never fatal."""

import copy
import json

import pytest

from prefixcache.core.retention import RetentionRange
from prefixcache.engine.chat_breakpoints import chat_token_ids
from prefixcache.engine.input_processor import tokenize_prompt
from prefixcache.explain.log import read_log, tokenize_body, tokenize_log

GOOD = [
    {"model": "m", "prompt": "The quick brown fox", "max_tokens": 5, "n": 3},
    {"prompt": [5, 6, 7], "cache_salt": "tenant"},
    {"prompt_token_ids": [8, 9], "prompt": None},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ]
    },
    {"prompt": "lazy dog", "lora_name": "adapter"},
]
BAD = {
    "{not json": "not JSON",
    "[1, 2]": "a JSON list",
    json.dumps({"max_tokens": 3}): "no prompt",
    json.dumps({"prompt": ""}): "empty",
    json.dumps({"prompt": ["a", "b"]}): "one prompt per logged request",
    json.dumps({"prompt": [[1, 2], [3]]}): "one prompt per logged request",
    json.dumps({"prompt": [1, "b"]}): "token ids",
    json.dumps({"prompt_token_ids": [1, -2]}): "token ids",
    json.dumps({"prompt_token_ids": [True, 2]}): "token ids",
    json.dumps({"prompt": 3}): "string or a list",
    json.dumps({"prompt": "x", "cache_salt": ""}): "cache_salt",
    json.dumps({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}): "both prompt and messages",
    json.dumps({"messages": []}): "non-empty list",
    json.dumps({"messages": [{"content": "no role"}]}): "bad message (messages.0.role",
    # Hostile lines: each once lost the whole report (RecursionError, OverflowError, TypeError).
    '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}": "nested too deeply",
    json.dumps({"prompt_token_ids": [1, 2**63]}): "token ids (integers in [0, 2^63))",
    json.dumps({"prompt": [3, 2**64 + 5]}): "token ids (integers in [0, 2^63))",
    '{"prompt": "a \\ud800 b"}': "prompt: invalid Unicode: a lone surrogate",
    '{"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "\\udc00"}]}': (
        "bad message (messages.1.content: invalid Unicode: a lone surrogate"
    ),
    '{"prompt": "x", "cache_salt": "\\udfff"}': "cache_salt: invalid Unicode",
}


def write_log(path, good, bad):
    """Good and bad lines interleaved, plus a blank line; returns the line numbers of the bad ones."""
    lines, bad_lines = [], {}
    bad_items = list(bad.items())
    for i in range(max(len(good), len(bad_items))):
        if i < len(good):
            lines.append(json.dumps(good[i]))
        if i < len(bad_items):
            lines.append(bad_items[i][0])
            bad_lines[len(lines)] = bad_items[i][1]
    lines.insert(2, "   ")
    bad_lines = {n + (n > 2): message for n, message in bad_lines.items()}
    path.write_text("\n".join(lines) + "\n")
    return bad_lines


def test_every_body_shape_is_read_as_the_engine_would_tokenize_it(tmp_path, tokenizer):
    path = tmp_path / "log.jsonl"
    write_log(path, GOOD, {})
    bodies, errors = read_log(path)
    prompts, token_errors = tokenize_log(bodies, lambda body: tokenize_body(body, tokenizer))
    assert errors == token_errors == []
    assert [p.token_ids for p in prompts] == [
        tokenize_prompt(tokenizer, "The quick brown fox")[1],
        [5, 6, 7],
        [8, 9],
        chat_token_ids(tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]),
        tokenize_prompt(tokenizer, "lazy dog")[1],
    ]
    assert [p.namespace for p in prompts] == [
        (None, None),
        ("tenant", None),
        (None, None),
        (None, None),
        (None, "adapter"),
    ]
    assert [p.line for p in prompts] == [1, 2, 4, 5, 6]  # line 3 is blank


def test_bad_lines_are_reported_with_their_number_and_skipped(tmp_path, tokenizer):
    path = tmp_path / "log.jsonl"
    bad_lines = write_log(path, GOOD, BAD)
    bodies, errors = read_log(path)
    prompts, token_errors = tokenize_log(bodies, lambda body: tokenize_body(body, tokenizer))
    assert len(prompts) == len(GOOD)
    reported = {e.line: e.message for e in errors + token_errors}
    assert sorted(reported) == sorted(bad_lines)
    for line, expected in bad_lines.items():
        assert expected in reported[line], (line, reported[line])


def test_token_ids_outside_the_vocabulary_are_refused_as_the_server_refuses_them(tmp_path, tokenizer):
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [5, 511]}) + "\n" + json.dumps({"prompt": [5, 512]}) + "\n")
    bodies, _ = read_log(path)
    prompts, errors = tokenize_log(bodies, lambda body: tokenize_body(body, tokenizer, vocab_size=512))
    assert [p.token_ids for p in prompts] == [[5, 511]]
    assert [(e.line, e.message) for e in errors] == [(2, "prompt token ids must be in [0, 512)")]


def test_a_chat_prompt_keeps_its_messages_to_locate_a_divergence(tmp_path, tokenizer):
    path = tmp_path / "log.jsonl"
    write_log(path, GOOD, {})
    bodies, _ = read_log(path)
    prompts, _ = tokenize_log(bodies, lambda body: tokenize_body(body, tokenizer))
    assert prompts[3].messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    assert prompts[0].messages is None


def test_a_template_that_fails_is_a_bad_line(tmp_path, tokenizer):
    failing = copy.deepcopy(tokenizer)
    failing.chat_template = "{{ raise_exception('no system role') }}"
    logged = tmp_path / "log.jsonl"
    logged.write_text(json.dumps({"messages": [{"role": "system", "content": "x"}]}) + "\n")
    bodies, _ = read_log(logged)
    prompts, errors = tokenize_log(bodies, lambda body: tokenize_body(body, failing))
    assert prompts == [] and errors[0].line == 1 and "no system role" in errors[0].message


def test_a_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(OSError):
        read_log(tmp_path / "missing.jsonl")


def read_bodies(tmp_path, bodies) -> list:
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    return read_log(path)[0]


SYSTEM_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_directives_are_read_as_the_server_reads_them(tmp_path, tokenizer):
    marked = [{**SYSTEM_CHAT[0], "cache_control": {"type": "ephemeral", "ttl": "1h"}}, SYSTEM_CHAT[1]]
    bodies = read_bodies(
        tmp_path,
        [
            {"messages": marked, "timestamp": 12.5},
            {"prompt": [5, 6, 7, 8], "retention": [{"token_start": 0, "token_end": 2, "priority": 70,
                                                    "duration_ms": 1500}], "timestamp": "2026-12-01T21:00:00Z"},
            {"prompt_token_ids": [5, 6, 7], "prompt_cache_retention": "24h"},
        ],
    )  # fmt: skip
    prompts, errors = tokenize_log(bodies, lambda body: tokenize_body(body, tokenizer, locate_system=True))
    assert errors == []
    chat, ranges, persistent = prompts
    [breakpoint] = chat.retention
    assert (breakpoint.start, breakpoint.end, breakpoint.priority, breakpoint.ttl_s) == (0, chat.system_end, 80, 3600)
    assert tokenizer.decode(chat.token_ids[: chat.system_end]).endswith("Be brief.<|end|>")
    assert tokenizer.decode(chat.token_ids[chat.system_end :]).startswith("<|user|>")
    assert ranges.retention == (RetentionRange(0, 2, 70, 1.5),) and ranges.system_end is None
    assert persistent.retention == (RetentionRange(0, None, 90, 86400.0),)
    assert (chat.timestamp, ranges.timestamp, persistent.timestamp) == (12.5, 1796158800.0, None)


def test_directives_the_server_would_refuse_are_bad_lines(tmp_path, tokenizer):
    control = {"type": "ephemeral"}
    five = [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": control}] * 5}]
    bodies = read_bodies(
        tmp_path,
        [
            {"messages": five},
            {"prompt": [5, 6], "retention": [{"token_start": 0, "priority": 101}]},
            {"prompt": [5, 6], "retention": [{"token_start": 1, "token_end": 3, "priority": 50}]},
            {"prompt": [5, 6], "prompt_cache_retention": "1h"},
            {"messages": [{**SYSTEM_CHAT[0], "cache_control": {"type": "ephemeral", "ttl": "2h"}}]},
            {"prompt": [5, 6], "timestamp": "yesterday"},
        ],
    )
    prompts, errors = tokenize_log(bodies, lambda body: tokenize_body(body, tokenizer))
    assert prompts == []
    messages = [e.message for e in errors]
    assert "at most 4 cache_control breakpoints" in messages[0]
    assert messages[1].startswith("retention.0.priority: ")
    assert messages[2] == "retention range 1..3 is past the prompt of 2 tokens"
    assert messages[3].startswith("prompt_cache_retention: ")
    assert "messages.0.cache_control.ttl" in messages[4]
    assert "neither seconds nor an ISO 8601 time" in messages[5]


HOUR, FIVE = {"type": "ephemeral", "ttl": "1h"}, {"type": "ephemeral"}
LOOKUP = {"name": "lookup", "description": "Find a word", "input_schema": {"type": "object"}}


def test_a_messages_api_body_is_read_as_the_chat_it_runs_as(tmp_path, tokenizer):
    """``system`` as the first message (its blocks joined), the tool as the OpenAI function it renders as, and a
    breakpoint after the tool, after a system block and (top-level ``cache_control``) after the last message's
    content, each at the strongest breakpoint covering it, as the chat endpoint places them."""
    body = {
        "model": "m",
        "max_tokens": 8,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": HOUR}, {"type": "text", "text": " Always."}],
        "tools": [{**LOOKUP, "cache_control": FIVE}],
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                     {"role": "user", "content": [{"type": "text", "text": "Why?"}]}],
        "cache_control": FIVE,
        "timestamp": 3.0,
    }  # fmt: skip
    [logged] = read_bodies(tmp_path, [body])
    prompts, errors = tokenize_log([logged], lambda body: tokenize_body(body, tokenizer))
    assert errors == []
    [prompt] = prompts
    function = {"type": "function", "function": {"name": "lookup", "description": "Find a word",
                                                 "parameters": {"type": "object"}}}  # fmt: skip
    turns = [{"role": "system", "content": "Be brief. Always."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Why?"}]  # fmt: skip
    assert prompt.token_ids == chat_token_ids(tokenizer, turns, tools=[function])
    assert prompt.messages == tuple(turns) and prompt.timestamp == 3.0
    text = tokenizer.decode(prompt.token_ids)
    tool_end = text.index("<|end|>")
    ends = [text.index("Be brief.") + len("Be brief."), text.index("Why?") + len("Why?")]
    assert (
        [(tokenizer.decode(prompt.token_ids[: r.end]), r.priority, r.ttl_s) for r in prompt.retention]
        == [
            (text[:tool_end], 80, 3600.0),  # the tool, covered by the later 1h system block
            (text[: ends[0]], 80, 3600.0),
            (text[: ends[1]], 60, 300.0),
        ]
    )


def test_a_messages_api_body_the_server_would_refuse_is_a_bad_line_naming_the_field(tmp_path):
    asked = [{"role": "user", "content": "Hi"}]
    marked = [{"type": "text", "text": "x", "cache_control": FIVE}]
    two_hours = [{**marked[0], "cache_control": {**FIVE, "ttl": "2h"}}]
    refused = [
        ({"system": "x", "messages": [{"role": "assistant", "content": "prefill"}]}, "the last message"),
        ({"system": two_hours, "messages": asked}, "system.0.cache_control.ttl"),
        ({"system": marked * 4, "messages": asked, "cache_control": FIVE}, "at most 4 cache_control breakpoints"),
        ({"tools": [{"input_schema": {}}], "messages": asked}, "tools.0.name"),
    ]
    bad = {json.dumps(body): named for body, named in refused}
    path = tmp_path / "log.jsonl"
    lines = write_log(path, [{"system": "Be brief.", "messages": asked}], bad)
    bodies, errors = read_log(path)
    assert [b.body["messages"][0] for b in bodies] == [{"role": "system", "content": "Be brief."}]
    assert [e.line for e in errors] == sorted(lines)
    for error in errors:
        assert error.message.startswith("a /v1/messages body the server would refuse (")
        assert lines[error.line] in error.message
