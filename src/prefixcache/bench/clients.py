"""``prefixcache bench clients``: the clients too heavy for CI, run as they come against ``prefixcache serve``.

guidellm (a benchmark tool for OpenAI servers), sglang-router and vllm-router install into venvs of their own
(``prefixcache.bench.peers``) on first use. One server is started on loopback; then, for each tool:

- guidellm runs with its defaults (the OpenAI HTTP backend: streamed chat completions with
  ``stream_options.continuous_usage_stats``) on synthetic prompts, synchronously, for ``--requests``
  requests; its tokenizer is the served checkpoint's, so nothing is downloaded.
- each router is started in front of the server (``cache_aware``) and sent a completion and a chat request,
  whole and streamed, greedy, through the official ``openai`` client; each answer must equal the server's
  own answer to the same request.

For every tool the report lists what it asked of the server (the paths and statuses of the server's request
log while it ran) and whether all of it succeeded. The README's client table comes from this command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from prefixcache.bench.live import ExternalProcess, Process, free_port

TOOLS = ("guidellm", "sglang-router", "vllm-router")
_LOGGED = re.compile(r"request_id=\S+ (GET|POST) (\S+) (\d{3})")
HI = [{"role": "user", "content": "Name three colours."}]


@dataclass(slots=True)
class ClientResult:
    """One tool's run: its version, whether everything it sent succeeded, what it asked of the server."""

    tool: str
    version: str
    passed: bool
    checks: dict[str, bool] = field(default_factory=dict)
    server_calls: dict[str, int] = field(default_factory=dict)  # "POST /v1/completions 200": count
    detail: str = ""


def _server_calls(log: str) -> dict[str, int]:
    return dict(sorted(Counter(" ".join(m) for m in _LOGGED.findall(log)).items()))


@contextlib.contextmanager
def _calls_during(server: Process, result: ClientResult) -> Iterator[None]:
    """Record in ``result`` the server's request-log lines written while the block runs."""
    start = len(server.log())
    try:
        yield
    finally:
        result.server_calls = _server_calls(server.log()[start:])


def run_guidellm(server: Process, model_dir: Path, args: argparse.Namespace, work: Path) -> ClientResult:
    from prefixcache.bench.peers import ensure_installed, peer_tool

    tool = peer_tool("guidellm")
    result = ClientResult(tool.name, tool.version, passed=False)
    executable = ensure_installed(tool)
    report = work / "guidellm.json"
    command = [
        str(executable), "run",
        "--backend", f"kind=openai_http,target={server.url}",
        "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
        "--output", f"kind=json,path={report}",
        "--disable-progress",
    ]  # fmt: skip
    with _calls_during(server, result):
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=args.timeout,
            cwd=work,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            check=False,
        )
    if done.returncode != 0 or not report.is_file():
        result.detail = f"exit {done.returncode}: {(done.stdout + done.stderr)[-1500:]}"
        return result
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]
    result.checks = {
        f"{totals['successful']} of {totals['total']} requests succeeded": totals["successful"] == totals["total"],
        "no request errored": totals["errored"] == 0,
    }
    ttft = metrics["time_to_first_token_ms"]["successful"]["mean"]
    result.detail = f"mean TTFT {ttft:.0f} ms, {metrics['output_tokens_per_second']['successful']['mean']:.1f} tok/s"
    result.passed = all(result.checks.values())
    return result


def _router_command(name: str, executable: Path, port: int, backend: str) -> list[str]:
    command = [str(executable), *(["launch"] if name == "sglang-router" else [])]
    return [*command, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", backend,
            "--policy", "cache_aware", "--prometheus-port", str(free_port())]  # fmt: skip


def _answers(base_url: str, model: str, max_tokens: int) -> dict[str, str]:
    """A greedy completion and chat answer, whole and streamed (SSE, with include_usage for chat).
    httpx.HTTPStatusError when the answer is not a 200."""
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    bodies = {
        "completion": ("/v1/completions", {"prompt": "The capital of France is", **common}),
        "chat": ("/v1/chat/completions", {"messages": HI, **common}),
    }
    answers: dict[str, str] = {}
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for kind, (path, body) in bodies.items():
            response = client.post(path, json=body)
            response.raise_for_status()
            choice = response.json()["choices"][0]
            answers[kind] = choice["message"]["content"] if "message" in choice else choice["text"]
            streamed = {
                **body,
                "stream": True,
                **({"stream_options": {"include_usage": True}} if kind == "chat" else {}),
            }
            text = []
            with client.stream("POST", path, json=streamed) as events:
                events.raise_for_status()
                for line in events.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        for delta in json.loads(line.removeprefix("data: "))["choices"]:
                            text.append(delta["delta"].get("content") or "" if "delta" in delta else delta["text"])
            answers[f"{kind}, streamed"] = "".join(text)
    return answers


def run_router(name: str, server: Process, model: str, args: argparse.Namespace, work: Path) -> ClientResult:
    from prefixcache.bench.peers import ensure_installed, peer_tool

    tool = peer_tool(name)
    result = ClientResult(tool.name, tool.version, passed=False)
    executable = ensure_installed(tool)
    expected = _answers(server.url, model, args.output_tokens)
    port = free_port()
    workers = 1 if name == "sglang-router" else None  # it registers its worker after it answers /health
    command = _router_command(name, executable, port, server.url)
    with _calls_during(server, result), ExternalProcess(command, port, work / f"{name}.log", workers=workers) as router:
        router.wait_ready(args.timeout)
        deadline = time.monotonic() + args.timeout
        while True:  # a router may take a moment after /health before it forwards: retry until one request passes
            try:
                got = _answers(router.url, model, args.output_tokens)
                break
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                if time.monotonic() > deadline:
                    result.detail = f"{type(exc).__name__}: {exc}"[:1500]
                    return result
                time.sleep(1.0)
    result.checks = {f"{kind} equals the server's own answer": got[kind] == expected[kind] for kind in expected}
    refused = {call: n for call, n in result.server_calls.items() if call.endswith(("400", "404", "422", "500"))}
    result.detail = f"refused by the server: {refused}" if refused else ""
    result.passed = all(result.checks.values())
    return result


def format_results(results: Sequence[ClientResult]) -> str:
    lines = []
    for r in results:
        lines.append(
            f"{r.tool} {r.version}: {'passed' if r.passed else 'FAILED'}" + (f" ({r.detail})" if r.detail else "")
        )
        lines += [f"    {'ok  ' if ok else 'FAIL'} {check}" for check, ok in r.checks.items()]
        lines += [f"    server saw {n} x {call}" for call, n in r.server_calls.items()]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> list[ClientResult]:
    """Each tool of ``args.tools`` in turn against one server; loads nothing until called (the CLI parser
    imports this module)."""
    from prefixcache.bench.peers import PeerInstallError
    from prefixcache.model.loader import resolve_model

    model_dir, model = resolve_model(args.model)
    results: list[ClientResult] = []
    with tempfile.TemporaryDirectory(prefix="prefixcache-clients-") as tmp:
        work = Path(tmp)
        serve = ["serve", str(model_dir), "--served-model-name", model, "--dtype", args.dtype]
        serve += ["--max-model-len", str(args.max_model_len), "--disable-uvicorn-access-log"]
        with Process(serve, work / "serve.log") as server:
            server.wait_ready(args.timeout)
            for name in args.tools:
                try:
                    if name == "guidellm":
                        results.append(run_guidellm(server, model_dir, args, work))
                    else:
                        results.append(run_router(name, server, model, args, work))
                except PeerInstallError as exc:
                    raise SystemExit(f"bench clients: {exc}") from None
                print(format_results(results[-1:]), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return results


def _tools(text: str) -> list[str]:
    names = [t for t in text.split(",") if t]
    unknown = sorted(set(names) - set(TOOLS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"tools are a comma-separated subset of {','.join(TOOLS)}")
    return names


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``clients`` to the ``prefixcache bench`` subcommands."""
    parser = bench_subparsers.add_parser(
        "clients", help="guidellm, sglang-router and vllm-router against a server", description=__doc__
    )
    parser.add_argument("--model", default=None, help="HF checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--tools", type=_tools, default=list(TOOLS), help=f"comma-separated (default {','.join(TOOLS)})"
    )
    parser.add_argument("--requests", type=int, default=8, help="guidellm's request count (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="guidellm's prompt length (default 128)")
    parser.add_argument("--output-tokens", type=int, default=16, help="tokens per answer (default 16)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a tool may take (default 600)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> None:
    """Exits 1 when any tool failed."""
    if not all(result.passed for result in run(args)):
        sys.exit(1)
