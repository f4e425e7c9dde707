"""``prefixcache demo``: a short offline benchmark on the default model, then a chat answer.

Sized to finish in a few minutes on two busy CPU cores: 8 prompts of 576 tokens (two shared prefixes of 512),
8 output tokens, each engine warmed up and then timed twice in alternating order, each run followed by its prefill
part alone (see ``bench offline``): the 7 tokens a request decodes after its first are steps no cache shortens, so
the whole run stays below ``1/(1 - hit rate)`` by their share, and the prefill part shows what the cache does.
"""

from __future__ import annotations

import argparse
import time

from prefixcache.bench.offline import compare_cache_off_on, print_report, synthetic_workload
from prefixcache.config import EngineConfig
from prefixcache.engine import LLM, SamplingParams
from prefixcache.engine.core import load_engine_model

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."}
ROUNDS = 2
NUM_PROMPTS = 8


def main(args: argparse.Namespace) -> None:
    config = EngineConfig(dtype=args.dtype)
    print(f"loading the default model, SmolLM2-135M-Instruct (the first run converts its GGUF file), in {config.dtype}")
    print(f"  dtype {config.dtype_reason}")
    loaded = load_engine_model(config)
    workload = synthetic_workload(
        loaded.config.vocab_size,
        num_prompts=NUM_PROMPTS,
        prefix_len=512,
        suffix_len=64,
        num_prefixes=2,
        repeat=1,
        max_tokens=8,
    )
    print(
        f"\n{len(workload.prompts)} prompts: 2 shared prefixes of 512 tokens + 64 own tokens, 8 output tokens; "
        f"each engine warmed up, then {ROUNDS} timed runs of each, alternating which goes first, each followed by "
        "the same prompts with 1 output token (the prefill part)"
    )
    print_report(compare_cache_off_on(loaded, workload, config, rounds=ROUNDS))

    llm = LLM(loaded=loaded, config=config)
    greedy = SamplingParams(max_tokens=32, temperature=0.0)
    for question in ("What is the capital of France?", "What is the capital of Italy?"):
        start = time.perf_counter()
        out = llm.chat([SYSTEM, {"role": "user", "content": question}], greedy, use_tqdm=False)[0]
        print(f"\nQ: {question}\nA: {out.outputs[0].text.strip()}")
        print(
            f"   {time.perf_counter() - start:.2f} s; {out.num_cached_tokens} of {len(out.prompt_token_ids)} "
            "prompt tokens came from the prefix cache"
        )
