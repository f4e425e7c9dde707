"""What the API side of ``prefixcache serve`` costs per token of one stream, without a model: each step's
``EngineCoreOutputs`` (one token, encoded and decoded with msgspec as the IPC does) goes through
``AsyncLLM._dispatch`` (output processor, detokenizer, metrics) to the request's stream, and ``sse_events`` turns
it into its SSE chunk, on one event loop as in the server. Not counted: ZeroMQ, and the HTTP response's writes.

Real text (this repository's README) tokenized with the default model's tokenizer; chat chunks. Prints CPU µs
per token (the median of the rounds) and the load average; ``--profile`` prints cProfile's top functions instead.
Run: ``PYTHONPATH=src python benchmarks/server_path_cost.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import time
from pathlib import Path

import msgspec

from prefixcache.core import MISS_REASONS
from prefixcache.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineStats
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.http.middleware import RequestRecord
from prefixcache.model.loader import load_tokenizer, resolve_model
from prefixcache.server.async_llm import AsyncLLM, RequestStream
from prefixcache.server.metrics import ServerMetrics
from prefixcache.server.responses import CHAT, ChoiceShaper
from prefixcache.server.streaming import sse_events

ROOT = Path(__file__).resolve().parent.parent


def stats(step: int) -> EngineStats:
    return EngineStats(
        prefix_cache_queries=64,
        prefix_cache_hits=0,
        prefix_cache_copied_tokens=0,
        prefix_cache_missed_tokens=dict.fromkeys(MISS_REASONS, 0),
        prefix_cache_hit_rate=0.0,
        rolling_hit_rate=0.0,
        num_requests=1,
        num_preemptions=0,
        kv_cache_usage=(step // 16 + 4) / 4096,  # a block filled every 16 tokens
        num_running=1,
        num_waiting=0,
        num_blocks=4096,
        block_size=16,
    )


async def one_stream(engine: AsyncLLM, ids: list[int], round_: int) -> tuple[float, int]:
    """CPU seconds for the whole stream, and its number of SSE chunks."""
    core_id = f"r{round_}-0"
    params = SamplingParams(max_tokens=len(ids), temperature=0.0)
    engine._output_processor.add_request(EngineCoreRequest(core_id, [1, 2, 3], params), None)
    stream = RequestStream(engine, f"r{round_}", [core_id])
    engine._streams[core_id] = stream
    shaper = ChoiceShaper(CHAT, engine.token_text)
    base = {"id": "chatcmpl-x", "object": CHAT.chunk_object, "created": 0, "model": "m"}
    record = RequestRecord("x", "POST", "/v1/chat/completions", 0.0)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineCoreOutputs)
    messages = []
    for step, token in enumerate(ids):
        finish = "length" if step == len(ids) - 1 else None
        output = EngineCoreOutput(core_id, [token], 3 if step == 0 else 0, finish_reason=finish)
        messages.append(encoder.encode(EngineCoreOutputs([output], time.monotonic(), stats(step))))
    chunks = 0
    events = sse_events(stream, shaper, base, True, 1, record)
    start = time.process_time()  # CPU time: on a shared machine, waiting for a core is not counted
    for message in messages:
        engine._dispatch(decoder.decode(message))
        chunk = await anext(events)
        chunks += len(chunk) > 0
    async for _ in events:  # usage, [DONE]
        chunks += 1
    return time.process_time() - start, chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", help="a model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    tokenizer = load_tokenizer(resolve_model(args.tokenizer)[0])  # the engine's own tokenizer
    ids = tokenizer.encode((ROOT / "README.md").read_text(), add_special_tokens=False)[: args.tokens]
    engine = AsyncLLM(None, tokenizer, ServerMetrics("m"))

    async def run() -> list[float]:
        times = []
        for round_ in range(args.rounds):
            seconds, _ = await one_stream(engine, ids, round_)
            times.append(seconds / len(ids) * 1e6)
        return times

    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        asyncio.run(run())
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return
    times = asyncio.run(run())
    print(f"{len(ids)} tokens a stream, {args.rounds} rounds: {' '.join(f'{t:.1f}' for t in times)} µs/token")
    print(f"median {statistics.median(times):.1f} µs/token")
    print("load average: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
