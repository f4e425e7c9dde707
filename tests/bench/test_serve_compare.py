"""``prefixcache bench serve-compare``: its options, the servers' command lines, the ratios it reports, a run."""

from __future__ import annotations

import json

import pytest

from prefixcache.bench import live, serve_compare
from prefixcache.bench.peers import installed, peer_tool
from prefixcache.cli import build_parser
from prefixcache.config import resolve_dtype


def parse(*argv: str):
    return build_parser().parse_args(["bench", "serve-compare", *argv])


def test_options_default_to_all_engines_on_two_threads() -> None:
    args = parse()
    assert args.engines == ["prefixcache", "llama.cpp", "vllm"]
    assert (args.quantization, args.threads, args.llamacpp_parallel) == (["none"], 2, 4)
    args = parse("--engines", "llama.cpp,prefixcache", "--quantization", "gguf,none", "--llamacpp-parallel", "16")
    assert (args.engines, args.quantization) == (["llama.cpp", "prefixcache"], ["gguf", "none"])
    assert args.llamacpp_parallel == 16


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--engines", "sglang"), ("--engines", ""), ("--quantization", "awq"), ("--llamacpp-parallel", "0")],
)
def test_bad_options_are_refused(flag: str, value: str, capsys) -> None:
    with pytest.raises(SystemExit):
        parse(flag, value)
    assert flag in capsys.readouterr().err


def test_prefixcache_is_started_with_the_users_defaults() -> None:
    assert serve_compare.prefixcache_serve_args(None, "gguf") == [
        "serve",
        "--quantization",
        "gguf",
        "--enable-reset-prefix-cache",
        "--disable-log-stats",
        "--disable-uvicorn-access-log",
    ]
    assert serve_compare.prefixcache_serve_args("/m.gguf", "none")[:2] == ["serve", "/m.gguf"]
    assert serve_compare.prefixcache_label("none", "bfloat16") == "prefixcache bfloat16"
    assert serve_compare.prefixcache_label("gguf", "bfloat16") == "prefixcache gguf"


def test_vllm_gets_its_reset_endpoint_and_the_same_threads(tmp_path, monkeypatch) -> None:
    script = tmp_path / "serve.sh"
    assert serve_compare.vllm_command(script, tmp_path / "model", 8200, "bfloat16") == [
        str(script),
        str(tmp_path / "model"),
        "8200",
        "bfloat16",
        "--uvicorn-log-level",
        "warning",
    ]
    monkeypatch.setattr(serve_compare.os, "cpu_count", lambda: 8)
    assert serve_compare.vllm_env(2) == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    monkeypatch.setattr(serve_compare.os, "cpu_count", lambda: 2)
    assert serve_compare.vllm_env(4)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"  # no more cores than the machine has


def test_each_server_starts_only_when_its_turn_comes(tmp_path, monkeypatch) -> None:
    started: list[list[str]] = []

    class RecordedPopen:
        def __init__(self, command, **kwargs) -> None:
            started.append(command)

    monkeypatch.setattr(live.subprocess, "Popen", RecordedPopen)
    script = tmp_path / "serve.sh"
    script.write_text("")
    args = parse("--engines", "prefixcache,vllm", "--quantization", "none,gguf", "--vllm-serve", str(script))
    launchers, notes = serve_compare.server_launchers(args, tmp_path / "model", tmp_path)
    dtype = resolve_dtype("auto", "cpu")[0]
    assert list(launchers) == [f"prefixcache {dtype}", "prefixcache gguf", "vLLM CPU"]
    assert (started, notes) == ([], [])  # nothing runs beside the engine being measured
    launchers["vLLM CPU"]()
    assert [command[0] for command in started] == [str(script)]


def row(label: str, fraction: float, ttft: float, tpot: float, throughput: float, completed: int = 30) -> dict:
    return {
        "label": label,
        "shared_fraction": fraction,
        "mean_ttft_ms": ttft,
        "mean_tpot_ms": tpot,
        "output_throughput": throughput,
        "completed": completed,
    }


def test_each_of_ours_is_compared_with_each_peer_at_each_point() -> None:
    rows = [
        row("prefixcache bfloat16", 0.0, 800, 90, 8.0),
        row("prefixcache bfloat16", 0.8, 200, 45, 8.0),
        row("llama.cpp (4 slots)", 0.0, 4000, 200, 7.5),
        row("llama.cpp (4 slots)", 0.8, 800, 50, 8.0),
        row("vLLM CPU", 0.0, 1600, 90, 7.0, completed=0),  # nothing finished: nothing to compare
        row("vLLM CPU", 0.8, 400, 30, 8.0),
    ]
    assert serve_compare.compare_rows(rows) == [
        {
            "shared_fraction": 0.0,
            "ours": "prefixcache bfloat16",
            "peer": "llama.cpp (4 slots)",
            "ttft_ratio": 0.2,
            "tpot_ratio": 0.45,
            "output_throughput_ratio": 1.067,
        },
        {
            "shared_fraction": 0.8,
            "ours": "prefixcache bfloat16",
            "peer": "llama.cpp (4 slots)",
            "ttft_ratio": 0.25,
            "tpot_ratio": 0.9,
            "output_throughput_ratio": 1.0,
        },
        {
            "shared_fraction": 0.8,
            "ours": "prefixcache bfloat16",
            "peer": "vLLM CPU",
            "ttft_ratio": 0.5,
            "tpot_ratio": 1.5,
            "output_throughput_ratio": 1.0,
        },
    ]


def test_a_server_that_counts_other_prompt_tokens_is_noted() -> None:
    rows = [
        {"label": "a", "shared_fraction": 0.0, "completed": 3, "input_len": 48, "total_input_tokens": 144},
        {"label": "b", "shared_fraction": 0.0, "completed": 3, "input_len": 48, "total_input_tokens": 147},  # a BOS
    ]
    assert serve_compare.prompt_length_notes(rows) == [
        "b at shared 0.0: the server counted 147 prompt tokens for 144 ids sent"
    ]


def run(*argv: str) -> dict:
    args = parse(*argv, "--disable-tqdm")
    return args.func(args)


WORKLOAD = ("--num-prompts", "3", "--input-len", "48", "--output-len", "4", "--request-rate", "inf")


def test_a_run_reports_each_engine_with_the_load_and_what_it_left_out(tiny_llama_dir, tmp_path) -> None:
    path = tmp_path / "report.json"
    report = run(
        "--model",
        str(tiny_llama_dir),
        "--engines",
        "prefixcache,llama.cpp",
        *WORKLOAD,
        "--sweep-shared-fractions",
        "0,0.5",
        "--logs",
        str(tmp_path / "logs"),
        "--json",
        str(path),
    )
    assert json.loads(path.read_text()) == report
    assert report["notes"] == ["llama.cpp left out: the model is not a GGUF"]
    rows = report["rows"]
    label = f"prefixcache {resolve_dtype('auto', 'cpu')[0]}"  # the server's default dtype on this CPU
    assert [(r["label"], r["shared_fraction"], r["completed"]) for r in rows] == [(label, 0.0, 3), (label, 0.5, 3)]
    assert all(r["total_input_tokens"] == 3 * 48 and r["cache_reset"] for r in rows)
    assert rows[1]["hit_rate"] > 0  # 24 shared tokens, computed once, found by the later requests
    assert report["comparisons"] == []  # no peer ran
    assert list(report["load_average_around"]) == [label]
    assert [len(load) for load in report["load_average_around"][label]] == [3, 3]
    assert (tmp_path / "logs" / "prefixcache-none.log").is_file()


def test_token_id_prompts_reach_llamacpp_without_a_bos(tmp_path) -> None:
    """llama.cpp counts exactly the ids sent as the prompt: the prompts all engines get are the same tokens."""
    from prefixcache.bench.peers import LLAMACPP_SERVE
    from prefixcache.model.loader import default_gguf_path

    if not installed(peer_tool("xllamacpp")) or not LLAMACPP_SERVE.is_file():
        pytest.skip(f"llama.cpp's server is not installed (the xllamacpp peer and {LLAMACPP_SERVE})")
    try:
        default_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    report = run("--engines", "llama.cpp", *WORKLOAD, "--sweep-shared-fractions", "0,0.5")
    assert [(r["label"], r["completed"], r["total_input_tokens"]) for r in report["rows"]] == [
        ("llama.cpp (4 slots)", 3, 3 * 48)
    ] * 2
    assert report["notes"] == []
