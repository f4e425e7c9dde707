"""``RequestStream``: what a consumer that fell behind gets from the outputs queued for it meanwhile."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from prefixcache.engine.outputs import CompletionOutput, RequestOutput
from prefixcache.server.async_llm import EngineDeadError, RequestStream


def output(token_ids: list[int], new: list[int], finished: bool = False, error: str | None = None) -> RequestOutput:
    """A choice's state after a step: all its tokens so far (text: each id in brackets), and the new ones."""
    text = "".join(f"[{t}]" for t in token_ids)
    completion = CompletionOutput(
        index=0,
        text=text,
        token_ids=token_ids,
        finish_reason="length" if finished else None,
        error=error,
    )
    new_text = "".join(f"[{t}]" for t in new)
    return RequestOutput("r", None, [1, 2], [completion], finished, 0, new_token_ids=new, new_text=new_text)


def consume(stream: RequestStream) -> list[tuple[int, list[int], str, bool]]:
    async def run() -> list[tuple[int, list[int], str, bool]]:
        return [(i, o.new_token_ids, o.new_text, o.finished) async for i, o in stream]

    return asyncio.run(run())


def new_stream(num_choices: int) -> RequestStream:
    aborted: list[str] = []
    engine = SimpleNamespace(_abort=lambda core_id, arrival: aborted.append(core_id))
    return RequestStream(engine, "r", [f"r-{i}" for i in range(num_choices)])


def test_outputs_queued_for_one_choice_come_out_joined_in_order_until_it_finishes():
    stream = new_stream(2)
    for item in [
        (0, output([5], [5])),
        (0, output([5, 6], [6])),
        (1, output([7], [7])),  # another choice: ends the run of choice 0
        (0, output([5, 6, 8], [8], finished=True)),
        (1, output([7, 9], [9])),
        (1, output([7, 9, 3], [3], finished=True)),
    ]:
        stream._put(item)
    assert consume(stream) == [
        (0, [5, 6], "[5][6]", False),
        (1, [7], "[7]", False),
        (0, [8], "[8]", True),
        (1, [9, 3], "[9][3]", True),
    ]


def test_an_output_with_an_error_is_not_joined_so_the_tokens_before_it_still_go_out():
    stream = new_stream(1)
    stream._put((0, output([5], [5])))
    stream._put((0, output([5, 6], [6], finished=True, error="sampling failed")))
    assert consume(stream) == [(0, [5], "[5]", False), (0, [6], "[6]", True)]


def test_a_failure_queued_behind_outputs_is_raised_after_them():
    stream = new_stream(1)
    stream._put((0, output([5], [5])))
    stream._put((0, output([5, 6], [6])))
    stream._put(EngineDeadError("the engine core is gone"))
    seen: list[list[int]] = []

    async def run() -> None:
        async for _, o in stream:
            seen.append(o.new_token_ids)

    with pytest.raises(EngineDeadError, match="gone"):
        asyncio.run(run())
    assert seen == [[5, 6]]


def test_a_consumer_that_keeps_up_gets_every_output_alone():
    stream = new_stream(1)

    async def run() -> list[list[int]]:
        async def produce() -> None:
            for n in range(1, 4):
                stream._put((0, output(list(range(n)), [n - 1], finished=n == 3)))
                await asyncio.sleep(0)  # the consumer takes each output before the next arrives

        producer = asyncio.ensure_future(produce())
        seen = [o.new_token_ids async for _, o in stream]
        await producer
        return seen

    assert asyncio.run(run()) == [[0], [1], [2]]
