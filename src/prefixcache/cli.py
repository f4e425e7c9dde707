"""The ``prefixcache`` command line. Heavy imports (torch, the server) happen inside each command."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _bench_manager(args: argparse.Namespace) -> None:
    from prefixcache.bench.manager import ManagerTraceConfig, run

    config = ManagerTraceConfig(num_requests=args.num_requests, num_blocks=args.num_blocks, seed=args.seed)
    run(args.hash_algo, args.repeats, args.json, config)


def build_parser() -> argparse.ArgumentParser:
    from prefixcache.core import HASH_ALGOS

    parser = argparse.ArgumentParser(prog="prefixcache", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR")
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    manager = bench.add_parser("manager", help="the cache manager's overhead on a fixed shared-prefix trace")
    manager.add_argument(
        "--hash-algo", nargs="+", default=list(HASH_ALGOS), choices=HASH_ALGOS, help="algorithms to compare"
    )
    manager.add_argument("--num-requests", type=int, default=2000)
    manager.add_argument("--num-blocks", type=int, default=10_000)
    manager.add_argument("--repeats", type=int, default=3, help="replays per algorithm; the best is reported")
    manager.add_argument("--seed", type=int, default=0)
    manager.add_argument("--json", type=Path, help="also write the results as JSON here")
    manager.set_defaults(func=_bench_manager)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        args.func(args)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
