"""Noticing that an HTTP client left while a handler awaits work that sends it nothing until the end."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``, but cancel it and return None if the client disconnects first.

    A handler that answers only once its work is done (a non-streaming completion, in the server or through
    the router) is otherwise never told that its client left, and would keep generating. The request's body
    must have been read already: what ``receive`` yields next is the disconnect.
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
