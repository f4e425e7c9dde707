"""The prefixcache command as a new user meets it: --help with defaults, one-line errors, answers that say when
they were cut."""

import argparse
import contextlib
import json
import logging
import socket

import pytest

from prefixcache.cli import build_parser, main


def subcommands(parser: argparse.ArgumentParser, name: str = "prefixcache"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child_name, child in action.choices.items():
                yield from subcommands(child, f"{name} {child_name}")


ALL = list(subcommands(build_parser()))


@pytest.mark.parametrize(("name", "parser"), ALL, ids=[name for name, _ in ALL])
def test_every_help_shows_its_defaults_and_no_double_backticks(name, parser):
    text = " ".join(parser.format_help().split())
    assert "``" not in text
    for action in parser._actions:
        default = action.default
        if not action.option_strings or default is None or default is False or default is argparse.SUPPRESS:
            continue
        if action.help and "default" in action.help:
            continue  # says it in its own words
        shown = " ".join(map(str, default)) if isinstance(default, list | tuple) else str(default)
        assert f"(default: {shown})" in text, f"{name} {action.option_strings[0]}"


def test_engine_flags_show_the_config_defaults():
    text = dict(ALL)["prefixcache generate"].format_help()
    for expected in ("(default: 16)", "(default: 1GiB)", "(default: auto)", "(default: sha256)", "(default: 64)"):
        assert expected in " ".join(text.split()), expected


def test_a_bad_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--no-such-flag"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --no-such-flag" in err and "--help" in err


def test_a_bad_model_path_is_one_line_without_a_traceback(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--model", str(tmp_path / "missing")])
    message = exit_info.value.code
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith("prefixcache generate: model ") and "not found" in message


def test_a_missing_log_file_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["explain", str(tmp_path / "missing.jsonl")])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read" in err


def test_a_chat_answer_cut_at_max_tokens_says_so(tiny_llama_dir, capsys):
    main(["chat", "hello", "--model", str(tiny_llama_dir), "--dtype", "float32", "--max-tokens", "1", "--system", ""])
    out = capsys.readouterr().out
    assert "cut at --max-tokens 1: raise it for a longer answer" in out


def test_the_start_up_line_names_the_dtype_and_why_under_the_default_level(tiny_llama_dir, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "level", logging.WARNING)  # the CLI's default level
    monkeypatch.setattr(logging.getLogger("prefixcache.engine.core"), "level", logging.NOTSET)
    main(["generate", "hi", "--model", str(tiny_llama_dir), "--dtype", "float32", "--max-tokens", "1"])
    lines = [r.getMessage() for r in caplog.records if r.name == "prefixcache.engine.core"]
    line = next(line for line in lines if line.startswith("engine: "))
    assert "in float32 (float32 as asked)" in line and "KV cache:" in line


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--port", "99999", "must be a port in [0, 65535]"),
        ("--shutdown-timeout", "-1", "must be a finite number >= 0"),
        ("--shutdown-timeout", "nan", "must be a finite number >= 0"),
    ],
)
def test_serve_refuses_a_bad_port_or_timeout_before_loading_anything(flag, value, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "missing-model", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument {flag}: {expected}" in err


def _held_port() -> socket.socket:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held


@pytest.mark.parametrize("case", ["too few blocks", "KV events endpoint in use"])
def test_an_engine_that_cannot_start_is_one_line_and_exit_1(tiny_llama_dir, case, capsys):
    """Raised in the engine core's process while it starts: once two tracebacks (the core's and uvicorn's
    lifespan) and exit 3, or an empty "prefixcache serve: " when closing the exiting core timed out."""
    with contextlib.ExitStack() as stack:
        if case == "too few blocks":
            flags, expected = ["--num-gpu-blocks-override", "1"], "(--num-gpu-blocks-override) is fewer than"
        else:
            held = stack.enter_context(_held_port())
            endpoint = f"tcp://127.0.0.1:{held.getsockname()[1]}"
            events = {"enable_kv_cache_events": True, "endpoint": endpoint, "endpoint_mode": "bind"}
            flags, expected = ["--kv-events-config", json.dumps(events)], "cannot open KV events endpoint"
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", str(tiny_llama_dir), "--port", "0", "--dtype", "float32", *flags])
    message = exit_info.value.code
    assert isinstance(message, str) and "\n" not in message  # sys.exit(str): printed as one line, exit 1
    assert message.startswith("prefixcache serve: ") and expected in message
    assert "Traceback" not in capsys.readouterr().err
