"""Noticing that a client left while its non-streaming request still runs, in the server and the router."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``, but cancel it and return None if the client disconnects first.

    A non-streaming handler is otherwise never told that its client left, and would keep generating.
    """

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None
