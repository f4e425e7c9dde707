"""``prefixcache router``: an OpenAI-compatible front that routes each request to one of several backends.

Only argparse work happens at import; the tokenizer and the web stack load when the command runs.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from prefixcache.argtypes import port
from prefixcache.http.flags import add_max_request_bytes
from prefixcache.router.policy import DEFAULT_AFFINITY_BALANCE, DEFAULT_PREFIX_WEIGHT, POLICIES
from prefixcache.router.wire import DEFAULT_CONTENT_BLOCK_SIZE

if TYPE_CHECKING:
    from prefixcache.router.subscriber import EventSource

logger = logging.getLogger(__name__)

BACKEND_API_KEY_ENV = "PREFIXCACHE_BACKEND_API_KEY"


def register(commands: argparse._SubParsersAction) -> None:
    """Add the ``router`` subcommand to the ``prefixcache`` command's subparsers."""
    parser = commands.add_parser(
        "router",
        help="route OpenAI requests to the backend holding their longest cached prefix",
        description="Proxy /v1/completions and /v1/chat/completions to OpenAI-compatible backends. The prefix "
        "policy predicts each backend's cache hit from its KV cache events and weighs it against the load: exactly "
        "for prefixcache serve backends (they report how they hash at /v1/cache/config), by the content of the "
        "events for others such as vLLM (name their event endpoints with --kv-event-source); backends without "
        "events are routed by load and affinity (prompt_cache_key, else the prompt's first blocks).",
    )
    parser.add_argument(
        "--backend",
        action="append",
        required=True,
        metavar="URL",
        help="a backend, e.g. http://10.0.0.2:8000 (repeat for each)",
    )
    parser.add_argument(
        "--kv-event-source",
        action="append",
        default=[],
        metavar="URL=ENDPOINT",
        help="where the backend URL publishes KV events, e.g. http://10.0.0.3:8000=tcp://10.0.0.3:5557 (a vLLM "
        "server's --kv-events-config endpoint; tcp://*:PORT means the backend's host); repeat per backend. For a "
        "prefixcache backend it replaces what /v1/cache/config reports",
    )
    parser.add_argument(
        "--kv-event-replay-source",
        action="append",
        default=[],
        metavar="URL=ENDPOINT",
        help="the replay endpoint of a backend given with --kv-event-source (its replay_endpoint)",
    )
    parser.add_argument(
        "--kv-event-block-size",
        type=int,
        default=DEFAULT_CONTENT_BLOCK_SIZE,
        help="block size of the --kv-event-source backends (their --block-size; default %(default)s)",
    )
    parser.add_argument(
        "--affinity-balance",
        type=float,
        default=DEFAULT_AFFINITY_BALANCE,
        help="an affinity key's backend keeps its requests while its requests in flight stay within this many "
        "times the mean, when no cached prefix decides (>= 1; 0: off, ties go to the least loaded; default "
        "%(default)s)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=port, default=8080, help="0 for any free port")
    parser.add_argument("--policy", choices=POLICIES, default="prefix")
    parser.add_argument(
        "--prefix-weight",
        type=float,
        default=DEFAULT_PREFIX_WEIGHT,
        help="cost of a prompt token to compute, in tokens of load (default %(default)s)",
    )
    parser.add_argument(
        "--tokenizer",
        "--model",
        dest="tokenizer",
        default=None,
        help="the backends' model, to tokenize like them: HF checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--health-check-interval", type=float, default=5.0, help="seconds between health checks")
    parser.add_argument("--health-check-timeout", type=float, default=2.0, help="seconds a health check may take")
    parser.add_argument(
        "--health-check-failures", type=int, default=2, help="failed checks in a row that take a backend out"
    )
    parser.add_argument("--replay-timeout", type=float, default=5.0, help="seconds to wait for a KV event replay")
    parser.add_argument("--request-timeout", type=float, default=None, help="seconds per read from a backend")
    parser.add_argument(
        "--backend-api-key",
        default=None,
        metavar="KEY",
        help="bearer token for the router's own calls to backends started with --api-key (default: "
        f"${BACKEND_API_KEY_ENV}); client requests keep their own Authorization header",
    )
    add_max_request_bytes(parser)
    parser.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    parser.set_defaults(func=run)


def backend_api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """--backend-api-key, else ${BACKEND_API_KEY_ENV} if set (the environment keeps it out of ``ps``)."""
    if args.backend_api_key is not None:
        return args.backend_api_key  # an empty one is refused by RouterSettings, not silently dropped
    return environ.get(BACKEND_API_KEY_ENV) or None


def event_sources(sources: list[str], replays: list[str]) -> tuple[tuple[str, EventSource], ...]:
    """``URL=ENDPOINT`` flags as (backend URL, addresses to connect to); ValueError naming the bad one."""
    from prefixcache.router.subscriber import EventSource

    endpoints = _url_map(sources, "--kv-event-source")
    replay_endpoints = _url_map(replays, "--kv-event-replay-source")
    orphans = sorted(set(replay_endpoints) - set(endpoints))
    if orphans:
        raise ValueError(f"--kv-event-replay-source for {', '.join(orphans)} without a --kv-event-source")
    return tuple((url, EventSource(endpoint, replay_endpoints.get(url))) for url, endpoint in endpoints.items())


def _url_map(values: list[str], flag: str) -> dict[str, str]:
    from prefixcache.router.backend_config import connect_address

    mapped: dict[str, str] = {}
    for value in values:
        url, separator, endpoint = value.rpartition("=")
        url = url.rstrip("/")
        scheme, _, address = endpoint.partition("://")
        if not separator or not url.startswith(("http://", "https://")) or scheme not in ("tcp", "ipc") or not address:
            example = "http://10.0.0.3:8000=tcp://10.0.0.3:5557"
            raise ValueError(f"{flag} takes URL=ENDPOINT such as {example}, got {value!r}")
        if url in mapped:
            raise ValueError(f"{flag} is given twice for {url}")
        connect = connect_address(endpoint, url)
        assert connect is not None  # only inproc:// has no address to connect to, and it is refused above
        mapped[url] = connect
    return mapped


def run(args: argparse.Namespace) -> None:
    import uvicorn

    from prefixcache.model.loader import load_tokenizer, resolve_model
    from prefixcache.router.app import RouterSettings, build_app
    from prefixcache.router.backends import HealthSettings

    try:
        settings = RouterSettings(
            backends=tuple(args.backend),
            policy=args.policy,
            prefix_weight=args.prefix_weight,
            health=HealthSettings(
                interval=args.health_check_interval,
                timeout=args.health_check_timeout,
                failures_to_down=args.health_check_failures,
                replay_timeout=args.replay_timeout,
            ),
            request_timeout=args.request_timeout,
            backend_api_key=backend_api_key(args, os.environ),
            event_sources=event_sources(args.kv_event_source, args.kv_event_replay_source),
            kv_event_block_size=args.kv_event_block_size,
            affinity_balance=args.affinity_balance,
            max_request_bytes=args.max_request_bytes,
        )
        tokenizer = load_tokenizer(resolve_model(args.tokenizer)[0]) if args.policy == "prefix" else None
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"prefixcache router: {exc}") from exc
    level = min(logging.INFO, logging.getLogger().getEffectiveLevel())
    logging.getLogger("prefixcache.router").setLevel(level)
    uvicorn.run(
        build_app(settings, tokenizer),
        host=args.host,
        port=args.port,
        log_level=level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=5,
    )
