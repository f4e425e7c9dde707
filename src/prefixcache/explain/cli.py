"""``prefixcache explain LOG``: why the prompts of a request log hit or miss the prefix cache.

Reads JSON lines (OpenAI completion or chat bodies, Anthropic Messages bodies, or {"prompt": ...} /
{"prompt_token_ids": [...]}; ``cache_salt`` honoured) and, without running the model, reports the hit rate an
infinite cache would give, token-exact and in whole blocks, where prompts part from earlier ones and why, what
would fix it, and missed tokens by reason. ``--capacity-tokens`` replays the log through the real cache manager to
count evictions (honouring the log's retention directives, timed by its ``timestamp`` fields when every line
has one); ``--breakpoint`` replays it again with a breakpoint added to every request, beside the rate
without; ``--base-url`` tokenizes through a running server and adds what its cache holds now (the replay
then admits through the server's KV cache groups, and the server's chat render places breakpoints).
``--kv-cache-memory`` (and the engine flags beside it) replays through the cache ``serve`` would lay out in that
memory. A model with recurrent layers (Qwen3.5, Granite 4.0-H, LFM2) is always replayed, its state checkpoints
budgeted and placed as the engine does (``serve``'s default memory unless given), and its misses include
``no_checkpoint``: blocks cached where no checkpoint lay, with what a checkpoint there would have saved.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from prefixcache.argtypes import non_negative_int, positive_int
from prefixcache.config import DTYPES, EngineConfig
from prefixcache.core import EVICTION_POLICIES, HASH_ALGOS
from prefixcache.engine.args import config_default

if TYPE_CHECKING:
    from prefixcache.engine.cache_layout import CacheLayout
    from prefixcache.model.config import ModelConfig

DEFAULT_BLOCK_SIZE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", type=Path, help="JSON-lines request log")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="tokenizer of this HF checkpoint or .gguf file (default: the default model)")
    source.add_argument("--base-url", help="a running prefixcache server: its tokenizer and its cache now")
    parser.add_argument("--api-key", help="Bearer key for --base-url")
    parser.add_argument(
        "--block-size", type=positive_int, help=f"engine block size (default {DEFAULT_BLOCK_SIZE}, or the server's)"
    )
    parser.add_argument(
        "--capacity-tokens",
        type=positive_int,
        help="replay through a cache of this many tokens (with --base-url on a recurrent model: the server's blocks)",
    )
    engine = parser.add_argument_group("the replay's cache as serve lays it out (with --model)")
    engine.add_argument(
        "--kv-cache-memory",
        help="replay through the cache serve would have in this memory, e.g. 2GiB (its blocks, unless"
        " --capacity-tokens, and a recurrent model's state checkpoints; default for such a model: serve's,"
        f" {config_default('kv_cache_memory')})",
    )
    engine.add_argument("--dtype", choices=DTYPES, default=config_default("dtype"), help="serve's --dtype")
    engine.add_argument(
        "--max-state-checkpoint-fraction",
        type=float,
        default=config_default("max_state_checkpoint_fraction"),
        help="serve's share of the memory for a recurrent model's state checkpoints",
    )
    engine.add_argument(
        "--max-num-seqs", type=positive_int, default=config_default("max_num_seqs"), help="serve's --max-num-seqs"
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=config_default("max_num_batched_tokens"),
        help="serve's prefill chunk: the replay prefills in chunks of this many tokens",
    )
    engine.add_argument("--max-model-len", type=positive_int, help="serve's --max-model-len (default: the model's)")
    parser.add_argument(
        "--breakpoint",
        type=breakpoint_spec,
        metavar="WHERE[:TTL]",
        help="with --capacity-tokens: the hit rate with a cache_control breakpoint added to every request, WHERE"
        " 'system' (after the leading system messages) or N (after the first N tokens), TTL 5m (default) or 1h",
    )
    parser.add_argument("--eviction-policy", choices=list(EVICTION_POLICIES), default="lru")
    parser.add_argument("--hash-algo", choices=HASH_ALGOS, default="sha256")
    parser.add_argument("--window", type=positive_int, default=8, help="tokens of text shown each side of a split")
    parser.add_argument(
        "--rows", type=non_negative_int, default=30, help="requests listed in the table (all are in --json)"
    )
    parser.add_argument("--json", type=Path, help="write the whole report as JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG: how far each request shares, where prompts part")


def breakpoint_spec(text: str):
    """``--breakpoint``'s value, ``system`` or a token count, then optionally ``:5m`` or ``:1h``."""
    from prefixcache.explain.analysis import WhatIfBreakpoint

    where, _, ttl = text.partition(":")
    if where != "system" and not where.isdigit():
        raise argparse.ArgumentTypeError(f"WHERE is 'system' or a number of tokens, got {where!r}")
    try:
        return WhatIfBreakpoint(where if where == "system" else int(where), ttl or "5m")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(commands: argparse._SubParsersAction) -> None:
    """Add ``explain`` to the ``prefixcache`` subcommands."""
    parser = commands.add_parser("explain", help="why the prompts of a request log miss the prefix cache",
                                 description=__doc__)  # fmt: skip
    add_arguments(parser)
    parser.set_defaults(func=lambda args: run(parser, args))


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The command: read, tokenize, explain, print; a bad line is reported and skipped."""
    from prefixcache.explain.analysis import ExplainConfig, explain
    from prefixcache.explain.log import read_log
    from prefixcache.explain.report import format_report, to_json, write_plot
    from prefixcache.explain.sources import server_cache, server_client, through_server, through_tokenizer

    if args.breakpoint is not None and args.capacity_tokens is None and args.kv_cache_memory is None:
        parser.error("--breakpoint compares two replays: give --capacity-tokens or --kv-cache-memory too")
    if args.base_url and args.kv_cache_memory is not None:
        parser.error("--kv-cache-memory lays the cache out for --model; a server's cache is its own")
    if args.breakpoint is not None and args.breakpoint.at == "system" and args.base_url:
        parser.error("--breakpoint system needs the model's chat template: use --model, not --base-url")
    for output in (args.json, args.plot):  # before the work, not after it
        if output is not None and not output.parent.is_dir():
            parser.error(f"cannot write {output}: {output.parent} is not a directory")
    try:
        bodies, errors = read_log(args.log)
    except OSError as exc:
        parser.error(f"cannot read {args.log}: {exc.strerror or exc}")
    with contextlib.ExitStack() as stack:
        if args.base_url:  # the server also decodes text for the report, so its client lives as long as the command
            client = server_client(args.base_url, args.api_key)
            stack.callback(client.close)
            prompts, token_errors, decode, live_cached, server_block_size = through_server(bodies, client)
            source = f"{args.log} (tokenized by {args.base_url})"
            server = server_cache(client)
        else:
            locate_system = args.breakpoint is not None and args.breakpoint.at == "system"
            prompts, token_errors, decode, name, model_config = through_tokenizer(bodies, args.model, locate_system)
            live_cached, server_block_size = None, None
            source = f"{args.log} (tokenizer: {name})"
        if args.block_size and server_block_size and args.block_size != server_block_size:
            parser.error(f"--block-size {args.block_size} differs from the server's block size {server_block_size}")
        errors = sorted(errors + token_errors, key=lambda e: e.line)
        if not prompts:
            for error in errors:
                print(f"line {error.line}: {error.message}")
            raise SystemExit(f"prefixcache explain: {args.log} holds no usable request")
        block_size = args.block_size or server_block_size or DEFAULT_BLOCK_SIZE
        try:
            if args.base_url:
                cache = server if args.capacity_tokens is None else {**server, "capacity_tokens": args.capacity_tokens}
            else:
                cache = replay_cache(args, block_size, model_config)
            config = ExplainConfig(
                block_size=block_size,
                eviction_policy=args.eviction_policy,
                hash_algo=args.hash_algo,
                window_tokens=args.window,
                breakpoint=args.breakpoint,
                **cache,
            )
            explanation = explain(prompts, config, decode, live_cached)
        except ValueError as exc:  # a bad setting, or a prompt larger than --capacity-tokens
            parser.error(str(exc))
        print(format_report(explanation, source, errors, args.rows))
        try:
            if args.json is not None:
                text = json.dumps(to_json(explanation, source, errors), indent=2, ensure_ascii=False)
                args.json.write_text(text + "\n", encoding="utf-8", errors="backslashreplace")
            if args.plot is not None:
                write_plot(explanation, args.plot, str(args.log.name))
        except OSError as exc:
            raise SystemExit(f"prefixcache explain: cannot write {exc.filename}: {exc.strerror or exc}") from None


def replay_cache(args: argparse.Namespace, block_size: int, model_config: ModelConfig) -> dict:
    """The ``ExplainConfig`` fields of the cache the replay runs through: the engine's prefill chunk, the model's
    KV cache groups and, with
    ``--kv-cache-memory`` or for a model with recurrent layers, what the engine would lay out (its blocks unless
    ``--capacity-tokens`` says how many, its state checkpoints and their policy); ValueError for a bad setting."""
    from prefixcache.core import KVCacheGroupSpec

    chunk = args.max_num_batched_tokens
    if args.kv_cache_memory is None and not model_config.state_layers:
        groups = tuple(KVCacheGroupSpec(group.sliding_window) for group in model_config.kv_cache_groups())
        return {"kv_cache_groups": groups, "capacity_tokens": args.capacity_tokens, "max_chunk_tokens": chunk}
    layout = engine_layout(args, block_size, model_config)
    return {
        "max_chunk_tokens": chunk,
        "kv_cache_groups": layout.groups,
        "capacity_tokens": args.capacity_tokens or layout.num_blocks * block_size,
        "num_state_slots": max(1, layout.num_state_slots),
        "num_checkpoint_slots": layout.num_checkpoint_slots,
        "checkpoint_policy": layout.checkpoint_policy(block_size),
    }


def engine_layout(args: argparse.Namespace, block_size: int, model_config: ModelConfig) -> CacheLayout:
    """The engine's layout of the cache for these flags (``engine.cache_layout``, the one the engine runs)."""
    from prefixcache.engine.cache_layout import cache_layout

    config = EngineConfig(
        block_size=block_size,
        kv_cache_memory=args.kv_cache_memory or config_default("kv_cache_memory"),
        num_blocks=args.capacity_tokens // block_size if args.capacity_tokens else None,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        max_state_checkpoint_fraction=args.max_state_checkpoint_fraction,
    )
    return cache_layout(config, model_config)
