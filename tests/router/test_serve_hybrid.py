"""The router in front of a real ``prefixcache serve`` of a hybrid model with KV events: it predicts every hit the
backend reports, for a tiny Gemma 3 (two sliding-window groups and a full-attention one) and for a tiny Qwen3.5
(Gated DeltaNet layers and full attention) whose blocks and state checkpoints went to its host tier.

A small pool makes the full group evict early blocks of the shared document while the sliding groups still
hold them, and chunked prefill makes the sliding groups give back the blocks that left their window; the
any-group rule (a hash held by some group) over-predicts there, the engine's rule per group does not.
"""

import random

import httpx

from prefixcache.core import FULL_ATTENTION, KVCacheGroupSpec
from prefixcache.model.loader import load_tokenizer
from prefixcache.router.prompt import PromptHasher
from prefixcache.router.proxy import BACKEND_HEADER
from tests.helpers import hybrid_workload, wait_until
from tests.model.conftest import write_checkpoint
from tests.router.fakes import metric
from tests.router.test_serve_backends import kv_events_args, start_router, start_servers

BLOCK_SIZE = 16
NUM_BLOCKS = 36  # a request of 9 blocks holds 9 in the full group and up to 4 in each sliding group
# chunks of two blocks: the sliding groups give blocks back during prefill
HYBRID_ARGS = [
    "--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS), "--max-num-batched-tokens", "32",
    "--max-model-len", "512", "--dtype", "float32",
]  # fmt: skip
GROUPS = (KVCacheGroupSpec(32), FULL_ATTENTION, KVCacheGroupSpec(32))


def test_the_router_predicts_a_hybrid_backends_hits_exactly(tiny_gemma3_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_gemma3_dir)
    [server] = start_servers(tiny_gemma3_dir, tmp_path, [[*HYBRID_ARGS, *kv_events_args()]])
    router = start_router([server], "prefix", tokenizer)
    try:
        pool, index = router.app.state.pool, router.app.state.index
        assert pool.reference.group_specs == GROUPS  # known from /v1/cache/config, before any event
        hasher = PromptHasher.for_engine(tokenizer, pool.reference)
        over_predicted_by_any_group = hits = 0
        for prompt in hybrid_workload("hybrid-router", 32, BLOCK_SIZE):
            hashes = hasher.key(prompt).block_hashes
            held_by_some_group = next((i for i, h in enumerate(hashes) if not index.holds(server.url, h)), len(hashes))
            predicted_before = metric(router, "predicted_cached_tokens_total")
            body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
            response = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert response.headers[BACKEND_HEADER] == server.url
            reported = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert metric(router, "predicted_cached_tokens_total") - predicted_before == reported
            hits += reported > 0
            over_predicted_by_any_group += held_by_some_group * BLOCK_SIZE > reported
            # the prompt's last block is stored in its last step's batch: once the router holds it, that batch
            # (and every earlier one) is applied, and the next prediction reads the cache the backend admits from
            last_block = hasher.key(prompt + [0]).block_hashes[-1]
            wait_until(lambda h=last_block: index.holds(server.url, h), what="the request's events in the index")
        assert metric(router, "predicted_cached_tokens_total") == metric(router, "reported_cached_tokens_total")
        assert hits >= 10
        assert over_predicted_by_any_group >= 3  # the workload evicts and slides where the rules part
        assert metric(router, "bad_event_messages_total") == 0
    finally:
        router.stop()
        server.stop()


# The tiny Qwen3.5 with the pool of tests/offload/test_engine_offload_states.py: 12 blocks and 2 checkpoint slots,
# so three other prompts push a prompt's blocks and checkpoint into the host tier (write-back).
TIERED_ARGS = [
    "--block-size", str(BLOCK_SIZE), "--num-blocks", "12", "--kv-cache-memory", "60KiB", "--max-num-batched-tokens",
    "40", "--max-model-len", "512", "--dtype", "float32", "--kv-offload-cpu", "1MiB",
]  # fmt: skip
rng = random.Random(11)
DOCUMENT = [rng.randrange(3, 500) for _ in range(100)]  # 6 blocks and 4 tokens: its frontier checkpoint at 96
FILLERS = [[rng.randrange(3, 500) for _ in range(100)] for _ in range(3)]
PARTED = DOCUMENT[:80] + [7, 8, 9]  # parts after 5 blocks, where no checkpoint of the document lies
SECOND = DOCUMENT[:96] + [7, 8, 9]  # parts where the document's checkpoint lies


def test_the_router_predicts_a_hybrid_backends_hits_from_its_host_tier_exactly(tmp_path):
    model_dir = write_checkpoint(tmp_path / "model", "qwen3_5")
    tokenizer = load_tokenizer(model_dir)
    [server] = start_servers(model_dir, tmp_path, [[*TIERED_ARGS, *kv_events_args()]])
    router = start_router([server], "prefix", tokenizer)
    try:
        index = router.app.state.index
        hasher = PromptHasher.for_engine(tokenizer, router.app.state.pool.reference)

        def complete(prompt: list[int]) -> int:
            """Send ``prompt`` through the router; the hit it predicted is the one the backend reports."""
            predicted_before = metric(router, "predicted_cached_tokens_total")
            body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
            response = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            reported = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert metric(router, "predicted_cached_tokens_total") - predicted_before == reported
            last_block = hasher.key(prompt + [0]).block_hashes[-1]  # stored in the request's last step's batch
            wait_until(lambda: index.holds(server.url, last_block, "GPU", 0), what="the request's events in the index")
            return reported

        def step_the_backend() -> bool:
            """A request of less than a block, straight to the backend: its step delivers the events of what the
            tier wrote after the last one (a tier's writes are announced by the next step)."""
            body = {"prompt": [1, 2, 3], "max_tokens": 1}
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).raise_for_status()
            return False

        assert complete(DOCUMENT) == 0
        for filler in FILLERS:
            assert complete(filler) == 0
        blocks = hasher.key(SECOND).block_hashes[:6]

        def in_the_tier() -> bool:
            held = all(index.holds(server.url, h, "CPU", 0) for h in blocks)
            return held and index.holds(server.url, blocks[-1], "CPU", 1)

        wait_until(
            lambda: in_the_tier() or step_the_backend(), what="the document's blocks and checkpoint in the host tier"
        )
        assert not index.holds(server.url, blocks[0], "GPU")  # the device holds none of the document
        # The tier holds the 5 blocks PARTED shares, but no checkpoint after them: a hit there stops short of them.
        assert complete(PARTED) < 5 * BLOCK_SIZE
        assert complete(SECOND) == 6 * BLOCK_SIZE  # its blocks and the checkpoint at 96: device and tier
        assert metric(router, "predicted_cached_tokens_total") == metric(router, "reported_cached_tokens_total")
        assert metric(router, "bad_event_messages_total") == 0
    finally:
        router.stop()
        server.stop()
