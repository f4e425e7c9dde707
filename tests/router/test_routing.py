"""The router between fake backends and fake KV event publishers on loopback."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from prefixcache.router.backends import BackendPool, BackendRefusedError, HealthSettings
from prefixcache.router.index import PrefixIndex
from prefixcache.router.metrics import RouterMetrics
from tests.helpers import wait_until
from tests.router.fakes import (
    CLEARED,
    PROMPT,
    STREAM_CHUNKS,
    complete,
    event_hashes,
    index_blocks,
    metric,
    removed,
    served_by,
    stored,
)


def test_routing_follows_the_index(backend, publisher, router):
    pub_a, pub_b = publisher(), publisher()
    a, b = backend("a", pub_a), backend("b", pub_b)
    r = router([a, b])
    pub_b.publish([stored(event_hashes(PROMPT[:16]))])
    wait_until(lambda: index_blocks(r, b) == 4, what="b's blocks in the index")
    assert {served_by(complete(r)) for _ in range(3)} == {b.url}
    # b evicts the prompt and a caches it: the requests follow
    pub_b.publish([removed(event_hashes(PROMPT[:16]))])
    pub_a.publish([stored(event_hashes(PROMPT[:8]))])
    wait_until(lambda: index_blocks(r, b) == 0 and index_blocks(r, a) == 2, what="the move to a")
    assert served_by(complete(r)) == a.url
    assert metric(r, "events_received_total") == 3


def test_of_two_backends_holding_the_prompt_the_one_holding_it_retained_serves_it(backend, publisher, router):
    """Without retention the two take turns (the last assertion of the burst test below); a backend whose events
    say the prompt's blocks are retained keeps them longest, and gets every request for them."""
    pub_a, pub_b = publisher(), publisher()
    a, b = backend("a", pub_a), backend("b", pub_b)
    r = router([a, b], affinity_balance=0)
    hashes = event_hashes(PROMPT[:16])
    pub_a.publish([stored(hashes)])
    pub_b.publish([{**stored(hashes), "retention": [[90, 3600.0]] * len(hashes)}])
    wait_until(lambda: index_blocks(r, a) == 4 and index_blocks(r, b) == 4, what="both backends' blocks")
    assert {served_by(complete(r)) for _ in range(4)} == {b.url}


def test_a_burst_follows_the_request_in_flight_before_its_events_arrive(backend, publisher, router):
    """The backend computing a prompt is where the same prefix goes next, not where no events say it is."""
    pub_a, pub_b = publisher(), publisher()
    a, b = backend("a", pub_a), backend("b", pub_b)
    r = router([a, b], affinity_balance=0)
    a.proceed.clear()
    b.proceed.clear()
    with ThreadPoolExecutor(4) as clients:
        first = clients.submit(complete, r)
        wait_until(lambda: len(a.received) + len(b.received) == 1, what="the first request at a backend")
        computing = a if a.received else b
        rest = [clients.submit(complete, r) for _ in range(3)]
        wait_until(lambda: len(a.received) + len(b.received) == 4, what="the burst at the backends")
        assert len(computing.received) == 4
        assert index_blocks(r, computing) == 0  # no event came: only the requests in flight hold the prefix
        a.proceed.set()
        b.proceed.set()
        assert {served_by(f.result()) for f in [first, *rest]} == {computing.url}
    # once they ended and still no event came, the two backends are alike again and take turns
    assert {served_by(complete(r)) for _ in range(4)} == {a.url, b.url}


def test_salts_isolate_in_the_index(backend, publisher, router):
    pub_a, pub_b = publisher(), publisher()
    a, b = backend("a", pub_a), backend("b", pub_b)
    r = router([a, b], affinity_balance=0)
    pub_a.publish([stored(event_hashes(PROMPT[:16]))])
    pub_b.publish([stored(event_hashes(PROMPT[:16], cache_salt="tenant-1"))])
    wait_until(lambda: index_blocks(r, a) == 4 and index_blocks(r, b) == 4, what="both backends' blocks")
    assert served_by(complete(r)) == a.url
    assert served_by(complete(r, cache_salt="tenant-1")) == b.url
    # another tenant's salt matches neither: both score alike and are used in turn
    assert {served_by(complete(r, cache_salt="tenant-2")) for _ in range(4)} == {a.url, b.url}


def test_text_and_chat_prompts_are_tokenized_and_hashed_like_the_engine(backend, publisher, router, tiny_llama_dir):
    from prefixcache.model.loader import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama_dir)
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi"}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat_ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    text = "The quick brown fox jumps over the lazy dog. Prefix caching reuses shared prompts."
    text_ids = tokenizer.encode(text, add_special_tokens=False)
    pub_a, pub_b = publisher(), publisher()
    a, b = backend("a", pub_a), backend("b", pub_b)
    r = router([a, b], tokenizer=tokenizer)
    pub_a.publish([stored(event_hashes(chat_ids[: len(chat_ids) // 4 * 4]))])
    pub_b.publish([stored(event_hashes(text_ids[: len(text_ids) // 4 * 4]))])
    wait_until(lambda: index_blocks(r, a) > 0 and index_blocks(r, b) > 0, what="both prompts' blocks")
    chat = httpx.post(f"{r.url}/v1/chat/completions", json={"messages": messages}, timeout=30)
    assert served_by(chat) == a.url
    assert served_by(complete(r, prompt=text)) == b.url


def test_streaming_passes_through_unchanged_and_usage_is_compared(backend, publisher, router):
    pub = publisher()
    a = backend("a", pub)
    r = router([a])
    pub.publish([stored(event_hashes(PROMPT[:8]))])
    wait_until(lambda: index_blocks(r, a) == 2, what="a's blocks")
    body = {"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{r.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        received = b"".join(response.iter_raw())
    assert received == b"".join(STREAM_CHUNKS)
    assert a.received[-1] == body  # the request body reached the backend as sent
    assert metric(r, "predicted_cached_tokens_total", a) == 8
    assert metric(r, "reported_cached_tokens_total", a) == 8  # from the usage chunk
    assert metric(r, "tokens_in_flight", a) == 0  # the load was released when the stream ended


def test_a_dead_backend_is_skipped_and_its_request_retried(backend, publisher, router):
    pub = publisher()
    a, b = backend("a", pub), backend("b")
    r = router([a, b], policy="round_robin")
    pub.publish([stored(event_hashes(PROMPT[:8]))])
    wait_until(lambda: index_blocks(r, a) == 2, what="a's blocks")
    a.stop()
    responses = [complete(r) for _ in range(3)]
    assert [served_by(x) for x in responses] == [b.url] * 3
    assert metric(r, "retries_total", a) == 1  # one attempt hit a; a left the rotation at once
    assert index_blocks(r, a) == 0  # and its index entries went with it
    assert metric(r, "backend_up", a) == 0
    b.stop()
    assert complete(r).status_code == 502  # tried b, nothing left to retry on
    assert complete(r).status_code == 503  # nothing in the rotation


def test_a_server_error_before_any_byte_is_retried_elsewhere(backend, router):
    a, b = backend("a"), backend("b")
    a.fail_with = 500
    r = router([a, b], policy="round_robin")
    assert {served_by(complete(r)) for _ in range(2)} == {b.url}
    assert len(a.received) == 1 and len(b.received) == 2
    assert metric(r, "backend_up", a) == 1  # an error answer does not take the backend out
    b.fail_with = 503
    assert complete(r).status_code in (500, 503)  # the last attempt's answer is passed on


def test_a_sequence_gap_triggers_a_replay(backend, publisher, router):
    pub = publisher()
    a = backend("a", pub)
    r = router([a])
    wait_until(lambda: pub.replay_requests == [0], what="the initial replay")
    first, lost, last = (event_hashes(PROMPT[:16])[k : k + 1] for k in (0, 1, 2))
    pub.publish([stored(first)])
    wait_until(lambda: index_blocks(r, a) == 1, what="the first batch")
    pub.publish([stored(lost)], lose=True)
    pub.publish([stored(last)])
    wait_until(lambda: index_blocks(r, a) == 3, what="the replayed batch")
    assert pub.replay_requests == [0, 1]
    assert metric(r, "batches_dropped_total") == 0


def test_a_restarted_or_reset_backend_is_resynced(backend, publisher, router):
    pub = publisher()
    a = backend("a", pub)
    r = router([a])
    pub.publish([stored(event_hashes(PROMPT[:16])), stored(event_hashes(PROMPT[:8]), medium="CPU")])
    wait_until(lambda: index_blocks(r, a) == 4, what="a's blocks")
    pub.publish([CLEARED])  # the engine's own cache is reset; its host tier keeps its two blocks
    wait_until(lambda: index_blocks(r, a) == 2, what="the reset")
    pub.publish([stored(event_hashes(PROMPT[:16]))])
    wait_until(lambda: index_blocks(r, a) == 4, what="a's blocks again")
    pub.restart()  # sequence back to 0 with nothing said about the old blocks
    pub.publish([stored(event_hashes(PROMPT[:4]))])
    wait_until(lambda: index_blocks(r, a) == 1, what="the resync after the restart")
    assert metric(r, "resyncs_total", a) == 1


def test_a_backend_hashing_differently_is_refused(backend):
    a, b = backend("a"), backend("b", block_size=8)

    async def start() -> None:
        async with httpx.AsyncClient() as client:
            pool = BackendPool([a.url, b.url], PrefixIndex(), RouterMetrics(), client, HealthSettings())
            await pool.start()

    with pytest.raises(BackendRefusedError, match=r"block_size is 8, the other backends use 4"):
        asyncio.run(start())


def test_failing_health_checks_take_a_backend_out_and_a_changed_one_stays_out(backend, publisher, router):
    pub = publisher()
    a, b = backend("a"), backend("b", pub)
    r = router([a, b], policy="round_robin", interval=0.1)
    pub.publish([stored(event_hashes(PROMPT[:8]))])
    wait_until(lambda: index_blocks(r, b) == 2, what="b's blocks")
    b.healthy = False
    wait_until(lambda: metric(r, "backend_up", b) == 0, what="b leaving the rotation")
    assert index_blocks(r, b) == 0
    assert {served_by(complete(r)) for _ in range(3)} == {a.url}
    b.config = {**b.config, "hash_seed": "another-seed"}  # it comes back hashing differently
    b.healthy = True
    pool = r.app.state.pool
    refused = next(x for x in pool.backends if x.url == b.url)
    wait_until(lambda: refused.refused is not None, what="b refused")
    assert refused.refused == "hash_seed is 'another-seed', the other backends use 'router-tests'"
    assert {served_by(complete(r)) for _ in range(3)} == {a.url}


def test_a_router_started_late_learns_the_cache_from_the_replay_and_counts_what_is_gone(backend, publisher, router):
    pub = publisher()
    hashes = event_hashes(PROMPT[:16])
    for h in hashes:  # published before any router listened
        pub.publish([stored([h])], lose=True)
    del pub.buffer[0]  # the replay buffer no longer reaches back to the first batch
    a = backend("a", pub)
    r = router([a])
    wait_until(lambda: index_blocks(r, a) == 3, what="the replayed blocks")
    assert metric(r, "batches_dropped_total", a) == 1
    pub.publish([stored(event_hashes(PROMPT[:4]))])  # live again, in sequence: nothing more is lost
    wait_until(lambda: index_blocks(r, a) == 4, what="the live batch")
    assert metric(r, "batches_dropped_total", a) == 1
