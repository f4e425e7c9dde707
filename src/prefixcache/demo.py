"""``prefixcache demo``: a short offline benchmark on the default model, then a chat answer."""

from __future__ import annotations

import argparse
import time

from prefixcache.bench.offline import compare_cache_off_on, print_report, synthetic_workload
from prefixcache.engine import LLM, SamplingParams
from prefixcache.model import load_model

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."}


def main(args: argparse.Namespace) -> None:
    print("loading the default model, SmolLM2-135M-Instruct (the first run converts its GGUF file) ...")
    loaded = load_model(None, dtype=args.dtype)
    workload = synthetic_workload(
        loaded.config.vocab_size, num_prompts=16, prefix_len=512, suffix_len=64, num_prefixes=2, repeat=1, max_tokens=8
    )
    print(f"\n{len(workload.prompts)} prompts: 2 shared prefixes of 512 tokens + 64 own tokens, 8 output tokens")
    print_report(compare_cache_off_on(loaded, workload, dtype=args.dtype))

    llm = LLM(loaded=loaded, dtype=args.dtype)
    greedy = SamplingParams(max_tokens=32, temperature=0.0)
    for question in ("What is the capital of France?", "What is the capital of Italy?"):
        start = time.perf_counter()
        out = llm.chat([SYSTEM, {"role": "user", "content": question}], greedy, use_tqdm=False)[0]
        print(f"\nQ: {question}\nA: {out.outputs[0].text.strip()}")
        print(
            f"   {time.perf_counter() - start:.2f} s; {out.num_cached_tokens} of {len(out.prompt_token_ids)} "
            "prompt tokens came from the prefix cache"
        )
