"""What one ``Scheduler.schedule()`` costs with a long waiting queue, per policy, without a model.

64 requests run and 4 seats are freed before each step; one in five waiting requests is a question behind a
cached 2,048-token prefix, the others cold 1,024-token prompts. Prints the median of 60 steps.
Run: ``PYTHONPATH=src python benchmarks/scheduler_cost.py``.
"""

import random
import time

from prefixcache.core import KVCacheManager
from prefixcache.engine.request import EngineRequest, RequestStatus
from prefixcache.engine.sampling_params import SamplingParams
from prefixcache.engine.scheduler import Scheduler


def median_step_ms(policy: str, num_waiting: int) -> tuple[float, int]:
    rng = random.Random(1)
    system = [rng.randrange(1000) for _ in range(2048)]
    scheduler = Scheduler(KVCacheManager(num_blocks=20000, block_size=16), 64, 8192, policy)
    params = SamplingParams(max_tokens=4, temperature=0)
    for i in range(num_waiting + 400):
        tokens = system + [i, i + 1] if i % 5 == 0 else [rng.randrange(1000) for _ in range(1024)]
        scheduler.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=tokens, sampling_params=params))
    scheduler.schedule()
    times = []
    for _ in range(60):
        for request in scheduler.running[:4]:
            scheduler.finish(request, RequestStatus.FINISHED)
        start = time.perf_counter()
        scheduler.schedule()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1000, len(scheduler.waiting)


if __name__ == "__main__":
    for num_waiting in (100, 1000, 4000):
        for policy in ("fcfs", "cache-aware"):
            ms, waiting = median_step_ms(policy, num_waiting)
            print(f"{policy:<12} {waiting:>5} waiting: {ms:.2f} ms a step")
