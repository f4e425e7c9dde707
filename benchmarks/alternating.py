"""The measuring loop both model-speed scripts share: each case runs on every subject in turn, repeated, so a
busy machine slows all subjects alike; a case's rate is its tokens over the median CPU time of this process."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from functools import partial

Case = tuple[int, Callable[[object], object]]  # tokens the case processes, and how to run it on one subject


def cpu_seconds(run: Callable[[], object]) -> float:
    """CPU time of this process, not the wall clock: other processes on a shared machine do not count."""
    start = time.process_time()
    run()
    return time.process_time() - start


def compare_alternately(
    cases: Mapping[str, Case], subjects: Mapping[str, object], repeats: int, ratio: tuple[str, str, str]
) -> dict[str, dict[str, float]]:
    """Tokens per CPU second of every subject in every case, and ``ratio = (key, numerator, denominator)``
    between two subjects; printed per case as it completes."""
    key, numerator, denominator = ratio
    report: dict[str, dict[str, float]] = {}
    for case, (num_tokens, run) in cases.items():
        for subject in subjects.values():
            run(subject)  # warm up, and fill the cache for the decodes
        times: dict[str, list[float]] = {name: [] for name in subjects}
        for _ in range(repeats):
            for name, subject in subjects.items():
                times[name].append(cpu_seconds(partial(run, subject)))
        rates = {name: num_tokens / statistics.median(t) for name, t in times.items()}
        report[case] = {name: round(rate, 1) for name, rate in rates.items()}
        report[case][key] = round(rates[numerator] / rates[denominator], 2)
        print(f"{case}: " + ", ".join(f"{n} {r:.0f} tok/s" for n, r in rates.items()), f"-> {report[case][key]}x")
    return report
