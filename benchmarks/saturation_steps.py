"""Where the saturation workload's time goes, offline: ``--num-prompts`` prompts of ``--input-len`` tokens, the
first ``--shared-len`` of them shared, ``--output-len`` tokens each, added at once to one ``LLM`` (the shape of
``prefixcache bench serve-compare``'s saturation point, without the server). Prints each round's output tokens/s,
its prefill steps' and its decode steps' milliseconds (the median decode step too), and the load average; with
``--profile``, ``torch.profiler``'s top ops of one prefill step and of three decode steps. The first round warms up
(kernel selection, oneDNN's primitives for each shape). Each round's prompts are new, so nothing is cached across
rounds. Run: ``PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/saturation_steps.py --dtype bfloat16``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from prefixcache.config import QUANTIZATIONS, EngineConfig
from prefixcache.engine import LLM, SamplingParams
from prefixcache.engine.core import load_engine_model


def add_requests(llm: LLM, rng: random.Random, args: argparse.Namespace) -> None:
    vocab = llm.engine.info.vocab_size
    shared = rng.choices(range(2, vocab), k=args.shared_len)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for _ in range(args.num_prompts):
        llm.engine.add_request(shared + rng.choices(range(2, vocab), k=args.input_len - args.shared_len), params)


def run_round(llm: LLM, rng: random.Random, args: argparse.Namespace) -> tuple[float, list[float], list[float]]:
    """(seconds, prefill steps' ms, decode steps' ms): a step is a prefill step until every request has its first
    token."""
    add_requests(llm, rng, args)
    engine, prefill, decode, started = llm.engine, [], [], set()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        prefilling = len(started) < args.num_prompts
        step = time.perf_counter()
        outputs = engine.step()
        (prefill if prefilling else decode).append((time.perf_counter() - step) * 1e3)
        started.update(out.request_id for out in outputs if out.outputs[0].token_ids)
    return time.perf_counter() - start, prefill, decode


def profile_steps(llm: LLM, rng: random.Random, args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity, profile

    add_requests(llm, rng, args)
    started: set[str] = set()
    for label, steps in (("one prefill step", 1), ("three decode steps", 3)):
        while label.endswith("decode steps") and len(started) < args.num_prompts:  # the rest of the prefill
            started.update(out.request_id for out in llm.engine.step() if out.outputs[0].token_ids)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                llm.engine.step()
        print(f"{label}:\n{prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=15)}")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="none", choices=QUANTIZATIONS)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=500)
    parser.add_argument("--shared-len", type=int, default=400)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if not 0 <= args.shared_len <= args.input_len:
        parser.error("--shared-len must be between 0 and --input-len")
    config = EngineConfig(dtype=args.dtype, quantization=args.quantization)
    llm = LLM(config=config, loaded=load_engine_model(config))
    rng = random.Random(0)
    try:
        run_round(llm, rng, args)  # warm-up
        if args.profile:
            profile_steps(llm, rng, args)
            return
        print(
            f"{args.num_prompts} x {args.input_len} tokens ({args.shared_len} shared), {args.output_len} out, "
            f"{config.dtype} {config.quantization}, {os.environ.get('OMP_NUM_THREADS', 'default')} threads"
        )
        for r in range(args.rounds):
            seconds, prefill, decode = run_round(llm, rng, args)
            print(
                f"round {r + 1}: {args.num_prompts * args.output_len / seconds:.1f} output tok/s in {seconds:.2f} s; "
                f"prefill steps {' '.join(f'{ms:.0f}' for ms in prefill)} ms; {len(decode)} decode steps, "
                f"median {statistics.median(decode):.1f} ms"
            )
        print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        llm.engine.close()


if __name__ == "__main__":
    main()
