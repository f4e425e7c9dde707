"""The router in front of a real ``prefixcache serve`` of a hybrid model (a tiny Gemma 3: two sliding-window
groups and a full-attention one) with KV events: it predicts every hit the backend reports.

A small pool makes the full group evict early blocks of the shared document while the sliding groups still
hold them, and chunked prefill makes the sliding groups give back the blocks that left their window; the
any-group rule (a hash held by some group) over-predicts there, the engine's rule per group does not.
"""

import httpx

from prefixcache.core import FULL_ATTENTION, KVCacheGroupSpec
from prefixcache.model.loader import load_tokenizer
from prefixcache.router.prompt import PromptHasher
from prefixcache.router.proxy import BACKEND_HEADER
from tests.helpers import hybrid_workload, wait_until
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
