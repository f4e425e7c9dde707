"""What one ``Scheduler.schedule()`` costs with a long waiting queue, per policy, without a model.

64 requests run; before each step 4 of them finish and new requests arrive until the queue is back to its length.
The queue starts full of cold 1,024-token prompts; one in five arrivals is a question behind a cached 2,048-token
prefix, the others cold prompts. (What ``cache-aware``'s queue holds once it runs: it admits the questions ahead
of the cold prompts, so they do not pile up; a queue still full of questions costs the same at any length too, more
a step, as ``cache-aware`` looks 64 waiting requests up again each step and a question's lookup walks 128 blocks.)
Prints the median of 60 steps per policy and queue length, ``cache-aware`` over ``fcfs`` beside it, and the load
average. Run: ``PYTHONPATH=src python benchmarks/scheduler_cost.py``.
"""

import os
import random
import time

from prefixcache.core import KVCacheManager
from prefixcache.engine.request import EngineRequest, RequestStatus
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.scheduler import Scheduler

MAX_NUM_SEQS = 64
STEPS = 60
FINISHED_PER_STEP = 4


def median_step_ms(policy: str, num_waiting: int) -> tuple[float, int]:
    """The median ``schedule()`` time in ms with ``num_waiting`` waiting before each step, and the queue's length
    after the last."""
    rng = random.Random(1)
    system = [rng.randrange(1000) for _ in range(2048)]
    scheduler = Scheduler(KVCacheManager(num_blocks=20000, block_size=16), MAX_NUM_SEQS, 8192, policy)
    params = SamplingParams(max_tokens=4, temperature=0)
    ids = iter(range(10**9))

    def arrive(question: bool) -> None:
        i = next(ids)
        tokens = system + [i, i + 1] if question else [rng.randrange(1000) for _ in range(1024)]
        scheduler.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=tokens, sampling_params=params))

    arrive(question=True)
    scheduler.schedule()  # the prefix is cached from now on
    for _ in range(num_waiting + MAX_NUM_SEQS):
        arrive(question=False)
    scheduler.schedule()
    times = []
    for _ in range(STEPS):
        for request in scheduler.running[:FINISHED_PER_STEP]:
            scheduler.finish(request, RequestStatus.FINISHED)
        while len(scheduler.waiting) < num_waiting:
            arrive(question=rng.random() < 0.2)
        start = time.perf_counter()
        scheduler.schedule()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1000, len(scheduler.waiting)


if __name__ == "__main__":
    print(f"load average before: {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    for num_waiting in (64, 512, 4096):
        ms = {}
        for policy in ("fcfs", "cache-aware"):
            ms[policy], waiting = median_step_ms(policy, num_waiting)
            print(f"{policy:<12} {waiting:>5} waiting: {ms[policy]:.3f} ms a step")
        print(f"{'':<12} {num_waiting:>5} waiting: cache-aware / fcfs = {ms['cache-aware'] / ms['fcfs']:.1f}x")
    print(f"load average after: {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
