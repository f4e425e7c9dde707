"""The command-line flags the server and the router both take, with their defaults.

Only argparse work happens at import: ``prefixcache --help`` loads no web stack.
"""

from __future__ import annotations

import argparse

from prefixcache.argtypes import memory_size

DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # a 128k-token prompt is under 1 MiB, as text or as JSON token ids


def add_max_request_bytes(parser: argparse._ActionsContainer) -> None:
    """``--max-request-bytes``, which the server and the router both enforce (``BodyLimitMiddleware``)."""
    parser.add_argument(
        "--max-request-bytes",
        type=memory_size,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="refuse request bodies larger than this with 413, e.g. 8MiB (default 8MiB)",
    )
