"""The engine loop in-process: a failing step fails only the requests in flight, and the loop serves on."""

import asyncio

import pytest

from prefixcache.engine import LLM, SamplingParams
from prefixcache.server.async_engine import AsyncEngine, EngineDeadError
from prefixcache.server.metrics import ServerMetrics
from tests.server.harness import random_prompt


async def collect(engine: AsyncEngine, request_id: str, max_tokens: int = 4) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    stream = await engine.add_request(random_prompt(request_id, 10), params, request_id)
    return [t async for output in stream for t in output.new_token_ids]


async def fail_one_step_then_serve(llm: LLM) -> None:
    engine = AsyncEngine(llm.engine, ServerMetrics("tiny"))
    engine.start()
    real_step = llm.engine.step

    def broken_step():
        llm.engine.step = real_step
        raise RuntimeError("boom")

    llm.engine.step = broken_step
    try:
        with pytest.raises(EngineDeadError, match="boom"):
            await asyncio.wait_for(collect(engine, "doomed"), timeout=10)
        assert engine.is_running
        assert len(await asyncio.wait_for(collect(engine, "after"), timeout=10)) == 4
        stats = await engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0)
    finally:
        await engine.shutdown()


def test_a_failed_step_fails_its_requests_and_the_loop_keeps_serving(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), block_size=4, num_blocks=64)
    asyncio.run(fail_one_step_then_serve(llm))
