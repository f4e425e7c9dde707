"""``prefixcache serve --kv-events-config``: a real server's events reach a consumer, and a reset clears."""

import json

import httpx

from tests.kv_events.conftest import REPLAY_ATTEMPTS, EventConsumer
from tests.kv_events.vllm_wire import AllBlocksCleared, BlockStored, decoder
from tests.server.harness import ServerProcess

PROMPT_TOKENS = list(range(10, 30))  # five full blocks of 4


def replay_until(consumer: EventConsumer, wanted: type) -> list:
    """All events once one of type ``wanted`` has been sent (the server publishes asynchronously)."""
    for _ in range(REPLAY_ATTEMPTS):
        events = [e for _, batch in consumer.replay_batches(0) for e in batch.events]
        if any(isinstance(e, wanted) for e in events):
            return events
    raise AssertionError(f"no {wanted.__name__} event was published")


def test_a_served_completion_is_published_and_a_reset_clears(tiny_llama_dir, tmp_path):
    # ipc endpoints in a private directory: no port to race for.
    events_config = {
        "enable_kv_cache_events": True,
        "endpoint": f"ipc://{tmp_path}/events",
        "replay_endpoint": f"ipc://{tmp_path}/replay",
        "topic": "kv-events",
    }
    args = ["--block-size", "4", "--num-blocks", "64", "--enable-reset-prefix-cache"]
    server = ServerProcess(tiny_llama_dir, [*args, "--kv-events-config", json.dumps(events_config)], tmp_path / "log")
    consumer = EventConsumer(events_config["endpoint"], events_config["replay_endpoint"], b"kv-events")
    try:
        server.wait_ready()
        model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT_TOKENS, "max_tokens": 2, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        stored = [e for e in replay_until(consumer, BlockStored) if isinstance(e, BlockStored)]
        assert stored[0].token_ids == PROMPT_TOKENS
        assert stored[0].parent_block_hash is None
        assert len(stored[0].block_hashes) == 5
        log = server.log()
        assert f"KV events: published, bound at {events_config['endpoint']}, replay on " in log  # the server's
        assert f"KV events: bound at {events_config['endpoint']}, reachable from this host only" in log  # the core's
        kv_events = httpx.get(f"{server.url}/v1/cache/config", timeout=30).json()["kv_events"]
        assert kv_events["endpoint"] == events_config["endpoint"] and kv_events["endpoint_bound"] is True
        # a salted request's blocks are published under their salted hashes, never with the salt
        salted = {**body, "prompt": list(range(40, 60)), "cache_salt": "tenant-secret-4242"}
        assert httpx.post(f"{server.url}/v1/completions", json=salted, timeout=60).status_code == 200
        for _ in range(REPLAY_ATTEMPTS):
            payloads = [payload for _, payload in consumer.replay(0)]
            events = [e for payload in payloads for e in decoder.decode(payload).events]
            if any(isinstance(e, BlockStored) and e.token_ids[:1] == [40] for e in events):
                break
        else:
            raise AssertionError("the salted request's blocks were never published")
        assert not any(b"tenant-secret-4242" in payload for payload in payloads)
        assert httpx.post(f"{server.url}/reset_prefix_cache", timeout=30).status_code == 200
        assert isinstance(replay_until(consumer, AllBlocksCleared)[-1], AllBlocksCleared)
    finally:
        consumer.close()
        server.stop()
