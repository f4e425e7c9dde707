"""Backends that are not ours: vLLM-like fakes whose block hashes are random ids, indexed by the content of their
events; backends without events; bad input on the event wire."""

import logging
import random

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.bench.live import free_port
from prefixcache.router.app import RouterSettings
from prefixcache.router.cli import event_sources
from prefixcache.router.subscriber import MAX_SEQUENCE_GAP, EventSource
from tests.helpers import wait_until
from tests.router.fakes import PROMPT, complete, event_hashes, index_blocks, metric, served_by, stored


def predicted(r, backend=None) -> float:
    return metric(r, "predicted_cached_tokens_total", backend)


def reported(r, backend=None) -> float:
    return metric(r, "reported_cached_tokens_total", backend)


def in_step(r, *fakes) -> bool:
    """The router's index names exactly the blocks each fake holds."""
    return all(index_blocks(r, fake) == len(fake.blocks) for fake in fakes)


def test_predictions_match_what_the_backend_holds_after_stores_and_removals(vllm, router):
    a, b = vllm("a"), vllm("b")
    r = router([a, b], event_sources=[a.source(), b.source()])
    a.wait_subscribed(r)
    b.wait_subscribed(r)
    b.store(PROMPT)
    wait_until(lambda: in_step(r, a, b) and index_blocks(r, b) == 5, what="b's blocks in the index")
    assert served_by(complete(r)) == b.url
    assert predicted(r, b) == reported(r, b) == 16  # 4 hittable blocks of 4
    b.remove(PROMPT, from_block=2)
    wait_until(lambda: index_blocks(r, b) == 2, what="b's removal")
    assert served_by(complete(r)) == b.url
    assert predicted(r, b) == reported(r, b) == 16 + 8
    a.store(PROMPT)  # a now holds the whole prompt: the next request moves there
    wait_until(lambda: index_blocks(r, a) == 5, what="a's blocks")
    assert served_by(complete(r)) == a.url
    assert predicted(r, a) == reported(r, a) == 16


def test_served_prompts_and_evictions_keep_the_prediction_exact(vllm, router):
    """Tenants' prompts through two small caches that store what they serve and evict: predicted == held."""
    rng = random.Random(7)
    a, b = (vllm(name, capacity=12, auto_store=True) for name in ("a", "b"))
    r = router([a, b], event_sources=[a.source(), b.source()])
    a.wait_subscribed(r)
    b.wait_subscribed(r)
    systems = [[rng.randrange(1000) for _ in range(12)] for _ in range(6)]
    for _ in range(40):
        prompt = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randint(1, 9))]
        served_by(complete(r, prompt=prompt))
        wait_until(lambda: in_step(r, a, b), what="the index in step with both caches")
    assert reported(r) > 0
    assert predicted(r) == reported(r)
    assert metric(r, "blocks_unindexed_total") == metric(r, "bad_event_messages_total") == 0


def test_a_clear_drops_the_gpu_copies_and_keeps_the_offload_tiers(vllm, router):
    a = vllm("a")
    r = router([a], event_sources=[a.source()])
    a.wait_subscribed(r)
    a.store(PROMPT)
    a.store(PROMPT[:8], medium="CPU", with_tokens=False)  # vLLM's offloading: hashes only, known from the GPU store
    wait_until(lambda: index_blocks(r, a) == 5, what="a's blocks")
    a.clear()
    wait_until(lambda: index_blocks(r, a) == 2, what="the reset")
    assert served_by(complete(r)) == a.url
    assert predicted(r, a) == reported(r, a) == 8
    a.store(PROMPT[:12], medium="CPU", with_tokens=False)  # a block no longer known by its tokens
    wait_until(lambda: metric(r, "blocks_unindexed_total", a) == 1, what="the unknown block counted")
    assert index_blocks(r, a) == 2


def test_a_late_router_learns_from_the_replay_and_a_restart_is_resynced(vllm, router):
    a = vllm("a")
    a.store(PROMPT)  # before any router listened: only the replay buffer has it
    r = router([a], event_sources=[a.source()])
    wait_until(lambda: index_blocks(r, a) == 5, what="the replayed blocks")
    a.wait_subscribed(r)  # the live feed too, before the restart
    assert served_by(complete(r)) == a.url
    assert predicted(r, a) == reported(r, a) == 16
    a.restart()  # new ids, the sequence from 0, nothing said about the old blocks
    a.store(PROMPT[:8])
    wait_until(lambda: index_blocks(r, a) == 2 and metric(r, "resyncs_total", a) == 1, what="the resync")
    assert served_by(complete(r)) == a.url
    assert predicted(r, a) == reported(r, a) == 16 + 8


def test_garbage_on_the_wire_is_dropped_and_counted_and_routing_goes_on(vllm, router):
    a, b = vllm("a"), vllm("b")
    r = router([a, b], event_sources=[a.source(), b.source()])
    a.wait_subscribed(r)
    a.store(PROMPT)
    wait_until(lambda: index_blocks(r, a) == 5, what="a's blocks")
    pub = a.publisher
    pub.send_raw([b"", b"\0" * 8])  # two frames
    pub.send_raw([b"", b"\1\2", b"payload"])  # a sequence frame of two bytes
    pub.send_raw([b"", pub.next_seq.to_bytes(8, "big"), b"\xc1 not msgpack"])
    pub.send_raw([b"", (2**64 - 2).to_bytes(8, "big"), b""])  # past 2**63
    bad_store = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [1, 2, 3]}
    pub.publish([{**bad_store, "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None}])
    real_next = pub.next_seq
    pub.publish([stored([99])], seq=2**63 - 1)  # a forged sequence number, in the replay buffer too
    pub.next_seq = real_next
    pub.replay_prefix = [[b"", b"bad", b"payload"], [b"", b"x"]]  # a replay answering garbage first
    lost = PROMPT[:4] + [7] * 16
    a.publisher.publish([], lose=True)  # a gap: the next batch asks for a replay
    a.store(lost)
    wait_until(lambda: in_step(r, a) and index_blocks(r, a) == 9, what="the batches after the garbage")
    reasons = bad_reasons(r)
    assert reasons["frames"] >= 2 and reasons["sequence"] >= 4 and reasons["payload"] == 1 and reasons["event"] == 1
    assert metric(r, "batches_dropped_total") == 0
    assert metric(r, "resyncs_total") == 0  # the forged number neither counted 2**63 lost batches nor reset anything
    assert served_by(complete(r)) == a.url
    assert predicted(r, a) == reported(r, a) == 16


def bad_reasons(r) -> dict[str, float]:
    text = httpx.get(f"{r.url}/metrics").text
    return {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "prefixcache:router_bad_event_messages_total"
    }


def test_a_sequence_jump_is_believed_only_when_the_next_batch_follows_it(vllm, router):
    """Without a replay to check against: one wild number is dropped; two in a row are a new sequence."""
    a = vllm("a")
    r = router([a], event_sources=[(a.url, EventSource(a.publisher.endpoint, None))])
    a.wait_subscribed(r)
    a.store(PROMPT[:8])
    wait_until(lambda: index_blocks(r, a) == 2, what="a's blocks")
    real_next = a.publisher.next_seq
    far = real_next + MAX_SEQUENCE_GAP + 10
    a.publisher.publish([stored([1])], seq=far)
    a.publisher.next_seq = real_next  # the real sequence goes on
    a.store(PROMPT[:12])
    wait_until(lambda: index_blocks(r, a) == 3, what="the next real batch")
    assert bad_reasons(r) == {"sequence": 1}
    a.publisher.next_seq = far + 100
    a.store(PROMPT[:16])  # dropped, then believed when the next one follows
    a.store(PROMPT)
    wait_until(lambda: metric(r, "resyncs_total", a) == 1, what="the new sequence")
    # the picture starts afresh there: the one block stored hangs under a parent the router no longer knows
    wait_until(lambda: metric(r, "blocks_unindexed_total", a) == 1, what="the orphan counted")
    assert index_blocks(r, a) == 0 and bad_reasons(r) == {"sequence": 2}


def test_events_of_another_block_size_refuse_the_backend_naming_the_flag(vllm, router, caplog):
    caplog.set_level(logging.INFO, logger="prefixcache.router")
    a, b = vllm("a", block_size=8), vllm("b")
    r = router([a, b], event_sources=[a.source(), b.source()], kv_event_block_size=4)
    a.wait_subscribed(r)
    a.store(PROMPT)
    wait_until(lambda: metric(r, "backend_up", a) == 0, what="a refused")
    assert (
        f"backend {a.url} refused: its KV events carry blocks of 8 tokens and the router hashes prompts in blocks "
        "of 4: restart the router with --kv-event-block-size 8"
    ) in caplog.text
    assert {served_by(complete(r, prompt_cache_key=str(k))) for k in range(6)} == {b.url}


def test_a_backend_without_events_is_routed_by_load_and_never_predicted(vllm, router, caplog):
    caplog.set_level(logging.INFO, logger="prefixcache.router")
    a, b = vllm("a"), vllm("b")
    r = router([a, b], event_sources=[a.source()], affinity_balance=0)
    endpoint, replay = a.publisher.endpoint, a.publisher.replay_endpoint
    assert (
        f"backend {a.url} joins the rotation (subscribing to KV events at {endpoint}, replay from {replay}; keyed "
        "by content, blocks of 4 tokens)"
    ) in caplog.text
    assert (
        f"backend {b.url} joins the rotation (no /v1/cache/config and no --kv-event-source: routed by load and "
        "affinity)"
    ) in caplog.text
    b.store(PROMPT)  # b caches it, but nobody listens: the router cannot know
    assert sorted(served_by(complete(r)) for _ in range(4)) == sorted([a.url, b.url] * 2)
    assert predicted(r) == 0 and reported(r, b) == 32


def test_a_subscribed_backend_that_sends_nothing_while_serving_is_warned_about_once(vllm, router, caplog):
    caplog.set_level(logging.INFO, logger="prefixcache.router")
    a, b = vllm("a", auto_store=True), vllm("b", auto_store=True)
    silent = f"tcp://127.0.0.1:{free_port()}"  # nothing publishes there (a connect endpoint on the backend, say)
    r = router([a, b], event_sources=[(a.url, EventSource(silent, None)), b.source()])
    for k in range(12):
        served_by(complete(r, prompt=[k] * 9))
    warnings = [rec.getMessage() for rec in caplog.records if "sent no KV event" in rec.getMessage()]
    assert warnings == [
        f"backend {a.url} served 3 requests but sent no KV event on {silent}: nothing publishes there, so its "
        "cache is not predicted (routed by load). Check its --kv-events-config: an endpoint like tcp://HOST:PORT "
        "is connected to, not bound; bind tcp://*:PORT (or ipc://PATH on one host) and point the router there"
    ]


def test_salted_and_multimodal_blocks_are_not_indexed_and_a_lora_is_read_from_the_model(vllm, router):
    a, b = vllm("a"), vllm("b")
    r = router([a, b], event_sources=[a.source(), b.source()], affinity_balance=0)
    a.wait_subscribed(r)
    b.wait_subscribed(r)
    a.store(PROMPT, lora_name="adapter-1", extra_keys=[["adapter-1"]] * 5)
    b.store(PROMPT, extra_keys=[["a-cache-salt"]] + [None] * 4)  # the salt is on the first block: none keyable
    wait_until(lambda: index_blocks(r, a) == 5 and metric(r, "blocks_unindexed_total", b) == 5, what="both stores read")
    assert index_blocks(r, b) == 0
    assert served_by(complete(r, model="adapter-1")) == a.url
    assert predicted(r) == 16
    # the base model and a salted request match nothing: by load, in turn
    assert {served_by(complete(r)) for _ in range(2)} == {a.url, b.url}
    assert {served_by(complete(r, cache_salt="a-cache-salt")) for _ in range(2)} == {a.url, b.url}
    assert predicted(r) == 16


def test_prefixcache_and_vllm_backends_in_one_rotation(backend, publisher, vllm, router):
    pub = publisher()
    ours, theirs = backend("ours", pub), vllm("theirs")
    r = router([ours, theirs], event_sources=[theirs.source()])
    theirs.wait_subscribed(r)
    other = [5] * 20
    pub.publish([stored(event_hashes(PROMPT[:16]))])
    theirs.store(other)
    wait_until(lambda: index_blocks(r, ours) == 4 and index_blocks(r, theirs) == 5, what="both backends' blocks")
    assert served_by(complete(r)) == ours.url
    assert served_by(complete(r, prompt=other)) == theirs.url
    assert predicted(r, ours) == predicted(r, theirs) == 16


def test_event_source_flags_name_a_listed_backend_and_a_zmq_address():
    sources = event_sources(
        ["http://10.0.0.3:8000/=tcp://*:5557", "http://h:1=ipc:///tmp/kv"], ["http://10.0.0.3:8000=tcp://*:5558"]
    )
    assert sources == (
        ("http://10.0.0.3:8000", EventSource("tcp://10.0.0.3:5557", "tcp://10.0.0.3:5558")),  # a wildcard: its host
        ("http://h:1", EventSource("ipc:///tmp/kv", None)),
    )
    for bad in (["tcp://h:5557"], ["http://h:1=inproc://x"], ["http://h:1=tcp://"], ["h:1=tcp://h:2"]):
        with pytest.raises(ValueError, match="--kv-event-source takes URL=ENDPOINT"):
            event_sources(bad, [])
    with pytest.raises(ValueError, match="given twice"):
        event_sources(["http://h:1=tcp://h:2", "http://h:1/=tcp://h:3"], [])
    with pytest.raises(ValueError, match="--kv-event-replay-source for http://h:1 without a --kv-event-source"):
        event_sources([], ["http://h:1=tcp://h:2"])
    with pytest.raises(ValueError, match="names http://other:1, which is not one of the --backend URLs"):
        RouterSettings(backends=("http://h:1",), event_sources=event_sources(["http://other:1=tcp://o:2"], []))
    with pytest.raises(ValueError, match="affinity balance must be >= 1"):
        RouterSettings(backends=("http://h:1",), affinity_balance=0.5)
