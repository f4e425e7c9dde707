"""The prefixcache command line: benchmarks, a quick generate and chat, the demo, the server and explain."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from prefixcache.argtypes import ArgumentParser, positive_int

# Loggers whose INFO lines are the start-up report (model, dtype and why, KV cache): shown under the default level.
STARTUP_LOGGERS = ("prefixcache.engine.core",)


def _bench_manager(args: argparse.Namespace) -> None:
    from prefixcache.bench.manager import ManagerTraceConfig, run

    config = ManagerTraceConfig(num_requests=args.num_requests, num_blocks=args.num_blocks, seed=args.seed)
    run(
        args.hash_algo,
        args.repeats,
        args.json,
        config,
        compare_vllm=args.compare_vllm,
        retention=args.retention,
        retention_rule=args.retention_rule,
    )


def _generate(args: argparse.Namespace) -> None:
    from prefixcache.engine import LLM, SamplingParams
    from prefixcache.engine.args import engine_kwargs

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    for out in llm.generate(args.prompt, params, use_tqdm=len(args.prompt) > 1):
        print(out.outputs[0].text)
        print(_footer(out, args.max_tokens))


def _footer(out, max_tokens: int) -> str:
    """The line under an answer: its cache hit, and whether --max-tokens cut it."""
    line = f"[{out.num_cached_tokens} of {len(out.prompt_token_ids)} prompt tokens from the prefix cache"
    if out.outputs[0].finish_reason == "length":
        line += f"; cut at --max-tokens {max_tokens}: raise it for a longer answer"
    return line + "]"


def _chat(args: argparse.Namespace) -> None:
    """One question, or a conversation read line by line from stdin; earlier turns hit the prefix cache."""
    from prefixcache.engine import LLM, SamplingParams
    from prefixcache.engine.args import engine_kwargs

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    history = [{"role": "system", "content": args.system}] if args.system else []
    interactive = args.message is None
    messages = [args.message] if not interactive else (line.strip() for line in sys.stdin)
    if interactive and sys.stdin.isatty():
        print("chat: type a message and press Enter; Ctrl-D ends")
    for message in messages:
        if not message:
            continue
        history.append({"role": "user", "content": message})
        out = llm.chat(history, params, use_tqdm=False)[0]
        answer = out.outputs[0].text
        history.append({"role": "assistant", "content": answer})
        print(answer)
        print(_footer(out, args.max_tokens))


def _demo(args: argparse.Namespace) -> None:
    from prefixcache.demo import main as demo

    demo(args)


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="longest answer, in tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")


def build_parser() -> argparse.ArgumentParser:
    from prefixcache.bench import checkpoints as bench_checkpoints
    from prefixcache.bench import clients as bench_clients
    from prefixcache.bench import decode as bench_decode
    from prefixcache.bench import hybrid as bench_hybrid
    from prefixcache.bench import noisy as bench_noisy
    from prefixcache.bench import offline
    from prefixcache.bench import offload_live as bench_offload
    from prefixcache.bench import route as bench_route
    from prefixcache.bench import serve as bench_serve
    from prefixcache.bench import serve_compare as bench_serve_compare
    from prefixcache.bench import trace as bench_trace
    from prefixcache.config import DTYPES
    from prefixcache.core import HASH_ALGOS
    from prefixcache.core.retention_rules import RETENTION_RULES
    from prefixcache.engine.args import add_engine_args, config_default
    from prefixcache.explain.cli import register as register_explain
    from prefixcache.router.cli import register as register_router
    from prefixcache.server.cli import register as register_serve

    parser = ArgumentParser(prog="prefixcache", description=__doc__)
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="start-up lines are shown at any level; DEBUG also shows the traceback of an error",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    manager = bench.add_parser("manager", help="the cache manager's overhead on a fixed shared-prefix trace")
    manager.add_argument(
        "--hash-algo", nargs="+", default=list(HASH_ALGOS), choices=HASH_ALGOS, help="algorithms to compare"
    )
    manager.add_argument("--num-requests", type=positive_int, default=2000, help="requests in the trace")
    manager.add_argument("--num-blocks", type=positive_int, default=10_000, help="KV blocks of the manager")
    manager.add_argument("--repeats", type=positive_int, default=3, help="replays per algorithm; the best is reported")
    manager.add_argument("--seed", type=int, default=0, help="of the trace")
    manager.add_argument("--json", type=Path, help="also write the results as JSON here")
    manager.add_argument("--compare-vllm", action="store_true", help="also replay the trace through vLLM's manager")
    manager.add_argument(
        "--retention", action="store_true", help="also replay with every shared prefix marked retained (directives)"
    )
    manager.add_argument(
        "--retention-rule", choices=sorted(RETENTION_RULES), help="also replay with this retention rule (no directives)"
    )
    manager.set_defaults(func=_bench_manager)
    offline.register(bench)
    bench_serve.register(bench)
    bench_serve_compare.register(bench)
    bench_trace.register(bench)
    bench_route.register(bench)
    bench_offload.register(bench)
    bench_clients.register(bench)
    bench_hybrid.register(bench)
    bench_checkpoints.register(bench)
    bench_decode.register(bench)
    bench_noisy.register(bench)

    generate = commands.add_parser("generate", help="complete prompts on the command line")
    generate.add_argument("prompt", nargs="+", help="one or more prompts")
    _add_sampling_args(generate)
    add_engine_args(generate)
    generate.set_defaults(func=_generate)

    chat = commands.add_parser("chat", help="chat with the model (one message, or lines from stdin)")
    chat.add_argument("message", nargs="?", default=None, help="omit to read a conversation from stdin")
    chat.add_argument("--system", default="You are a helpful assistant.", help="system prompt ('' for none)")
    _add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=_chat)

    demo = commands.add_parser("demo", help="a short benchmark on the default model, then a chat answer")
    demo.add_argument(
        "--dtype",
        default=config_default("dtype"),
        choices=DTYPES,
        help="auto: as serve --dtype",
    )
    demo.set_defaults(func=_demo)
    register_serve(commands)
    register_explain(commands)
    register_router(commands)
    return parser


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    """Run a subcommand. What the user got wrong (a missing file, a bad model path or value) is one line on
    stderr and exit status 1; ``--log-level DEBUG`` shows its traceback. SIGTERM (``kill``, a CI timeout)
    unwinds like Ctrl-C, so a benchmark stops the servers it started instead of leaving them running;
    ``serve`` and ``router`` put uvicorn's own handlers in place while they serve."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in STARTUP_LOGGERS:
        logging.getLogger(name).setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))
    try:
        args.func(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except (OSError, ValueError) as exc:
        if args.log_level == "DEBUG":
            raise
        command = " ".join(filter(None, ("prefixcache", args.command, getattr(args, "bench", None))))
        sys.exit(f"{command}: {exc}")


if __name__ == "__main__":
    main()
