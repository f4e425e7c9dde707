"""``prefixcache serve``: load the model, then serve the OpenAI API with uvicorn.

Only argparse work happens at import; the engine and the web stack load when the command runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path

from prefixcache.argtypes import non_negative_float, port
from prefixcache.engine.args import add_engine_args, engine_kwargs
from prefixcache.http.flags import add_max_request_bytes
from prefixcache.server.settings import LOG_STATS_INTERVAL_S, ServerSettings

API_KEY_ENV = "PREFIXCACHE_API_KEY"
METRICS_API_KEY_ENV = "PREFIXCACHE_METRICS_API_KEY"


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand to the ``prefixcache`` command's subparsers."""
    parser = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible API (completions, chat, metrics)",
        description="Serve MODEL over OpenAI's HTTP API; all in-flight requests share one engine loop.",
    )
    add_engine_args(parser, model_positional=True)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=port, default=8000, help="0 for any free port")
    group.add_argument(
        "--served-model-name", nargs="+", default=None, help="names clients use for the model (default: its name)"
    )
    group.add_argument(
        "--api-key",
        action="append",
        default=None,
        help=f"require 'Authorization: Bearer KEY'; repeat for several keys, each a tenant with its own prefix "
        f"cache (default: ${API_KEY_ENV} if neither this nor --api-key-file is given)",
    )
    group.add_argument(
        "--api-key-file", type=Path, default=None, help="more API keys, one per line ('#' starts a comment)"
    )
    group.add_argument(
        "--metrics-api-key",
        default=None,
        metavar="KEY",
        help=f"require this key, and only this one, for GET /metrics, so tenants' keys cannot read the server-wide "
        f"counters (default: ${METRICS_API_KEY_ENV}; without either, /metrics takes any API key)",
    )
    group.add_argument(
        "--share-cache-across-keys",
        action="store_true",
        help="let requests of different API keys share cached prefixes (faster, but each tenant can then tell "
        "from cached_tokens and latency what the others sent; see the README's Security section)",
    )
    add_max_request_bytes(group)
    group.add_argument("--disable-log-requests", action="store_true", help="no log line per finished request")
    group.add_argument(
        "--enable-reset-prefix-cache",
        action="store_true",
        help="expose POST /reset_prefix_cache (it drops every tenant's cached prefixes)",
    )
    group.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput / hit-rate log line")
    group.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    group.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds in-flight requests may take to finish before they are ended (default 30)",
    )
    parser.set_defaults(func=serve)


def api_keys(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The keys of --api-key and --api-key-file, in order, without repeats; else ${API_KEY_ENV} if set."""
    keys = list(args.api_key or [])
    if args.api_key_file is not None:
        try:
            text = args.api_key_file.read_text()
        except OSError as exc:
            raise OSError(f"--api-key-file {args.api_key_file}: {exc.strerror or exc}") from exc
        for line in text.splitlines():
            key = line.split("#", 1)[0].strip()
            if key:
                keys.append(key)
    if not keys and environ.get(API_KEY_ENV):
        keys.append(environ[API_KEY_ENV])
    return tuple(dict.fromkeys(keys))


def server_settings(
    args: argparse.Namespace, model_name: str, keys: tuple[str, ...], environ: Mapping[str, str]
) -> ServerSettings:
    """The server's options, read once into its frozen settings (ValueError for a bad value)."""
    return ServerSettings(
        served_model_names=tuple(args.served_model_name or [model_name]),
        api_keys=keys,
        metrics_api_key=args.metrics_api_key or environ.get(METRICS_API_KEY_ENV) or None,
        share_cache_across_keys=args.share_cache_across_keys,
        enable_reset_prefix_cache=args.enable_reset_prefix_cache,
        log_stats_interval=None if args.disable_log_stats else LOG_STATS_INTERVAL_S,
        max_request_bytes=args.max_request_bytes,
        log_requests=not args.disable_log_requests,
    )


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound now, before the model loads: a port in use fails in a moment, not after the
    load. OSError when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # a restart may bind while the last run's connections linger in TIME_WAIT; a port in use still fails
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve(args: argparse.Namespace) -> None:
    """Exits 0 after a clean shutdown (SIGTERM/SIGINT), 1 when the engine core died or failed to start."""
    import dataclasses

    from prefixcache.config import EngineConfig
    from prefixcache.model.loader import load_tokenizer, resolve_model
    from prefixcache.server.app import build_app
    from prefixcache.server.async_llm import AsyncLLM
    from prefixcache.server.metrics import ServerMetrics
    from prefixcache.server.shutdown import DrainingServer

    try:
        config = EngineConfig(**engine_kwargs(args))
        keys = api_keys(args, os.environ)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"prefixcache serve: {exc}") from exc
    try:
        listener = listening_socket(args.host, args.port)
    except OSError as exc:
        raise SystemExit(
            f"prefixcache serve: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}"
        ) from None
    try:
        model_dir, model_name = resolve_model(config.model)
        settings = server_settings(args, model_name, keys, os.environ)
        tokenizer = load_tokenizer(model_dir)
    except (FileNotFoundError, ValueError) as exc:
        listener.close()
        raise SystemExit(f"prefixcache serve: {exc}") from exc
    # The stats line and uvicorn's startup line are the server's heartbeat: shown at INFO even under the CLI's
    # default WARNING level (--disable-log-stats and --disable-uvicorn-access-log quiet the periodic ones).
    level = min(logging.INFO, logging.getLogger().getEffectiveLevel())
    logging.getLogger("prefixcache.server").setLevel(level)
    metrics = ServerMetrics(settings.served_model_names[0])
    engine = AsyncLLM(dataclasses.replace(config, model=str(model_dir)), tokenizer, metrics)
    server = DrainingServer(
        build_app(engine, settings),
        engine,
        args.shutdown_timeout,
        host=args.host,
        port=args.port,
        log_level=level,
        access_log=not args.disable_uvicorn_access_log,
    )
    engine.on_dead = server.exit_soon
    server.run(sockets=[listener])
    if server.startup_error is not None:
        raise SystemExit(f"prefixcache serve: {server.startup_error}")
    if engine.dead or not server.started:
        raise SystemExit(1)
