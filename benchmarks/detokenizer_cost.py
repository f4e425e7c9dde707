"""What ``IncrementalDetokenizer`` costs per token, streaming real text one token at a time as the output processor
does (the token list grows, ``decode_new`` sees all of it each step, ``final`` at the end).

The text is this repository's README (a few thousand tokens) with some multi-byte characters appended, tokenized
with the default model's tokenizer (SmolLM2, as the engine loads it; or ``--tokenizer MODEL``). With ``--baseline REV``
the detokenizer of that git revision runs too, interleaved with the current one, and the ratio of the two is
printed per round (the machine is shared: compare the ratio, not the absolute numbers). The streamed text is
checked to be the same for both and equal to a one-shot decode. Prints the load average.
Run: ``PYTHONPATH=src python benchmarks/detokenizer_cost.py --baseline HEAD``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

from prefixcache.engine.detokenizer import IncrementalDetokenizer
from prefixcache.model.loader import load_tokenizer, resolve_model

ROOT = Path(__file__).resolve().parent.parent
EXTRA = "\nünïcode ✓, 中文字符, emoji 🙂🚀👍🏽 and ÅÄÖ survive token splits.\n" * 20


def baseline_class(rev: str) -> type:
    source = subprocess.run(
        ["git", "show", f"{rev}:src/prefixcache/engine/detokenizer.py"], cwd=ROOT, check=True, capture_output=True
    ).stdout.decode()
    module = types.ModuleType("baseline_detokenizer")
    sys.modules[module.__name__] = module  # dataclasses looks its module up
    exec(compile(source, f"{rev}:detokenizer.py", "exec"), module.__dict__)
    return module.IncrementalDetokenizer


def stream(cls: type, tokenizer, ids: list[int], skip: bool) -> tuple[float, str]:
    """CPU µs per token, and the text."""
    detokenizer = cls(tokenizer, skip_special_tokens=skip)
    shown: list[int] = []
    parts = []
    start = time.process_time()  # CPU time: on a shared machine, waiting for a core is not counted
    for token in ids:
        shown.append(token)
        parts.append(detokenizer.decode_new(shown))
    parts.append(detokenizer.decode_new(shown, final=True))
    elapsed = time.process_time() - start
    return elapsed / len(ids) * 1e6, "".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", help="a model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--baseline", help="a git revision whose detokenizer runs interleaved with this one")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    tokenizer = load_tokenizer(resolve_model(args.tokenizer)[0])  # the engine's own tokenizer
    ids = tokenizer.encode((ROOT / "README.md").read_text()[:12000] + EXTRA, add_special_tokens=False)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    classes = {"current": IncrementalDetokenizer}
    if args.baseline:
        classes["baseline"] = baseline_class(args.baseline)
    times: dict[str, list[float]] = {name: [] for name in classes}
    ratios = []
    for _ in range(args.rounds):
        for name, cls in classes.items():
            us, text = stream(cls, tokenizer, ids, skip=True)
            assert text == expected, f"{name}: streamed text differs from the one-shot decode"
            times[name].append(us)
        if args.baseline:
            ratios.append(times["current"][-1] / times["baseline"][-1])
    print(f"{len(ids)} tokens, {args.rounds} rounds")
    for name, values in times.items():
        print(f"{name}: median {statistics.median(values):.2f} µs/token (min {min(values):.2f})")
    if ratios:
        print(f"current / baseline per round: {' '.join(f'{r:.3f}' for r in ratios)}")
        minima = min(times["current"]) / min(times["baseline"])
        print(f"median ratio {statistics.median(ratios):.3f}, ratio of the minima {minima:.3f}")
    print("load average: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
