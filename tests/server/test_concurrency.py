"""Clients that hang up are aborted at once, not run to their max_tokens: in a burst of concurrent streams
the others still finish, afterwards nothing runs, waits or holds a KV block, and the aborts are counted
under ``finished_reason="abort"``."""

import asyncio
import contextlib

import httpx
import openai

from tests.helpers import scrape, wait_until
from tests.server.harness import delta, random_prompt

NUM_FINISHING = 6
NUM_LEAVING = 6
LONG = 230  # tokens a leaving client asks for (with its 20-token prompt, nearly the 256-token context)
HANG_S = 300  # bounds a hang only: a loaded machine may run these requests many times slower


async def finish(client: openai.AsyncOpenAI, model: str, i: int) -> int:
    stream = await client.completions.create(
        model=model, prompt=random_prompt(f"burst-{i}", 20), max_tokens=24, stream=True, extra_body={"ignore_eos": True}
    )
    return sum([len(chunk.choices) async for chunk in stream])


async def leave_mid_stream(client: openai.AsyncOpenAI, model: str, i: int) -> int:
    stream = await client.completions.create(
        model=model,
        prompt=random_prompt(f"leave-{i}", 20),
        max_tokens=LONG,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    async for _ in stream:
        received += 1
        if received == 3:
            break
    await stream.close()  # the connection is dropped with the response unread
    return received


async def leave_while_waiting(url: str, model: str) -> None:
    """A non-streaming client that gives up once its request is running, long before the answer is ready."""
    body = {"model": model, "prompt": random_prompt("impatient", 20), "max_tokens": LONG, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=HANG_S) as client:
        request = asyncio.create_task(client.post(f"{url}/v1/completions", json=body))
        # until it runs, however long a loaded machine takes to get there (the caller's wait_for bounds a hang)
        while (await asyncio.to_thread(scrape, url))["prefixcache:num_requests_running"] != 1:
            assert not request.done(), f"the request ended before it was seen running: {request.result().text}"
            await asyncio.sleep(0.05)
        assert not request.done(), f"a {LONG}-token completion finished at once; the test needs a slower request"
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request


async def burst(url: str, model: str) -> tuple[list[int], list[int]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=HANG_S)
    async with client:
        return await asyncio.wait_for(
            asyncio.gather(
                asyncio.gather(*(finish(client, model, i) for i in range(NUM_FINISHING))),
                asyncio.gather(*(leave_mid_stream(client, model, i) for i in range(NUM_LEAVING))),
            ),
            timeout=HANG_S,
        )


def wait_until_idle(url: str) -> dict[str, float]:
    """/metrics once nothing runs, waits or holds a block."""
    scrapes: list[dict[str, float]] = []

    def idle() -> bool:
        scrapes.append(metrics := scrape(url))
        return (
            metrics["prefixcache:kv_cache_usage_perc"] == 0
            and metrics["prefixcache:num_requests_running"] == 0
            and metrics["prefixcache:num_requests_waiting"] == 0
        )

    wait_until(idle, timeout=HANG_S, what="the server to drain")
    return scrapes[-1]


def test_streaming_clients_that_leave_are_aborted_and_their_blocks_freed(server, model_name):
    before = scrape(server.url)
    finished, left = asyncio.run(burst(server.url, model_name))
    assert finished == [24] * NUM_FINISHING
    assert left == [3] * NUM_LEAVING
    after = wait_until_idle(server.url)
    # All started; only the clients that stayed finished, the others were aborted before max_tokens (how
    # long before depends on the machine's speed, so the bound is only that they did not all run to the end).
    assert delta(before, after, "prompt_tokens_total") == 20 * (NUM_FINISHING + NUM_LEAVING)
    assert delta(before, after, 'request_success_total{finished_reason="length"}') == NUM_FINISHING
    assert delta(before, after, 'request_success_total{finished_reason="abort"}') == NUM_LEAVING
    assert delta(before, after, "generation_tokens_total") < NUM_FINISHING * 24 + NUM_LEAVING * LONG


def test_a_non_streaming_client_that_leaves_is_aborted(server, model_name):
    before = scrape(server.url)
    asyncio.run(asyncio.wait_for(leave_while_waiting(server.url, model_name), timeout=HANG_S))
    after = wait_until_idle(server.url)
    assert delta(before, after, "prompt_tokens_total") == 20
    assert delta(before, after, "request_success_total") == 1
    assert delta(before, after, 'request_success_total{finished_reason="abort"}') == 1
    assert delta(before, after, "generation_tokens_total") < LONG
