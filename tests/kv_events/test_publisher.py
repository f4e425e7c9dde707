"""The ZeroMQ publisher: vLLM's framing, sequence numbers, replay, drops that leave a gap, clean close."""

import logging
import socket
import threading

import pytest
import zmq

from prefixcache.kv_events.config import KVEventsConfig
from prefixcache.kv_events.events import AllBlocksCleared, BlockRemoved, KVEventBatch
from prefixcache.kv_events.publisher import NullEventPublisher, ZmqEventPublisher, make_publisher, reach
from tests.kv_events.conftest import LOOPBACK
from tests.kv_events.vllm_wire import decoder

WARM_UP_POLL_MS = 100


def removed(n: int) -> KVEventBatch:
    """A batch whose content names it: one BlockRemoved of hash ``n``."""
    return KVEventBatch(ts=float(n), events=[BlockRemoved(block_hashes=[n], medium="GPU")])


def removed_hash(payload: bytes) -> int:
    [event] = decoder.decode(payload).events
    return event.block_hashes[0]


def wait_until_subscribed(publisher: ZmqEventPublisher, consumer) -> int:
    """Publish warm-up batches until one arrives live (a SUB misses what is sent before it joined).

    Returns the sequence number the next batch will get.
    """
    for _ in range(100):
        publisher.publish(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
        message = consumer.receive(WARM_UP_POLL_MS)
        if message is not None:
            break
    else:
        pytest.fail("the subscriber never received a message")
    last = message[1]
    while (message := consumer.receive(WARM_UP_POLL_MS)) is not None:
        last = message[1]
    return last + 1


@pytest.fixture
def publishers():
    made: list[ZmqEventPublisher] = []

    def make(**kwargs) -> ZmqEventPublisher:
        kwargs.setdefault("endpoint", LOOPBACK)
        kwargs.setdefault("replay_endpoint", LOOPBACK)
        publisher = ZmqEventPublisher(**kwargs)
        made.append(publisher)
        return publisher

    yield make
    for publisher in made:
        publisher.close()


def test_messages_are_topic_sequence_and_payload_numbered_from_zero(publishers, consumers):
    publisher = publishers(topic="kv-events")
    consumer = consumers(publisher)
    first = wait_until_subscribed(publisher, consumer)
    for n in range(3):
        publisher.publish(removed(n))
    received = [consumer.receive() for _ in range(3)]
    assert [seq for _, seq, _ in received] == [first, first + 1, first + 2]
    assert all(topic == b"kv-events" for topic, _, _ in received)
    assert [removed_hash(payload) for _, _, payload in received] == [0, 1, 2]
    assert decoder.decode(received[0][2]).data_parallel_rank == 0
    # Sequence numbers start at 0: the replay buffer still holds the first warm-up.
    assert consumer.replay(0)[0][0] == 0


def test_a_topic_filter_sees_only_its_topic(publishers, consumers):
    publisher = publishers(topic="kv-events")
    other = consumers(publisher, topic=b"other")
    wait_until_subscribed(publisher, consumers(publisher, topic=b"kv"))
    publisher.publish(removed(7))
    assert other.receive(WARM_UP_POLL_MS) is None


def test_replay_sends_every_buffered_batch_from_the_start_seq_then_the_end_marker(publishers, consumers):
    publisher = publishers(buffer_steps=3)
    consumer = consumers(publisher)
    first = wait_until_subscribed(publisher, consumer)
    for n in range(5):
        publisher.publish(removed(n))
    for _ in range(5):
        assert consumer.receive() is not None  # all five were sent, so all are in the buffer
    replayed = consumer.replay(first + 3)
    assert [(seq, removed_hash(payload)) for seq, payload in replayed] == [(first + 3, 3), (first + 4, 4)]
    # Only the last buffer_steps batches are kept.
    assert [seq for seq, _ in consumer.replay(0)] == [first + 2, first + 3, first + 4]
    assert consumer.replay(first + 5) == []


def test_a_malformed_replay_request_is_ignored_and_the_next_one_served(publishers, consumers):
    publisher = publishers()
    consumer = consumers(publisher)
    first = wait_until_subscribed(publisher, consumer)
    consumer.replay_socket.send_multipart([b"", b"x", b"y"])  # four frames at the ROUTER
    assert [seq for seq, _ in consumer.replay(first - 1)] == [first - 1]


def test_a_full_queue_drops_batches_counts_them_and_leaves_a_sequence_gap(publishers, consumers, monkeypatch):
    publisher = publishers(max_queue_size=2)
    consumer = consumers(publisher)
    first = wait_until_subscribed(publisher, consumer)
    entered, release = threading.Event(), threading.Event()
    send = publisher._send

    def held_send(seq, batch):
        entered.set()
        release.wait()
        send(seq, batch)

    monkeypatch.setattr(publisher, "_send", held_send)
    publisher.publish(removed(0))
    assert entered.wait(10), "the publisher thread did not take the batch"
    for n in range(1, 6):  # two fit the queue, three are dropped; publish never blocks
        publisher.publish(removed(n))
    assert publisher.num_dropped == 3
    release.set()
    assert [consumer.receive()[1] for _ in range(3)] == [first, first + 1, first + 2]
    publisher.publish(removed(6))
    assert consumer.receive()[1] == first + 6
    assert publisher.num_dropped == 3
    # The gap cannot be replayed: a consumer must resync.
    assert [seq for seq, _ in consumer.replay(first + 3)] == [first + 6]


def test_close_sends_what_is_queued_stops_the_thread_and_refuses_more(publishers, consumers):
    publisher = publishers()
    consumer = consumers(publisher)
    first = wait_until_subscribed(publisher, consumer)
    publisher.publish(removed(1))
    publisher.close()
    assert consumer.receive()[1] == first
    assert not publisher._thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name == "kv-events-publisher"]
    with pytest.raises(RuntimeError, match="closed"):
        publisher.publish(removed(2))
    publisher.close()  # idempotent


def test_a_busy_endpoint_is_a_clear_error_and_leaves_nothing_running(publishers):
    taken = publishers()
    before = threading.active_count()
    with pytest.raises(ValueError, match="cannot open KV events endpoint"):
        ZmqEventPublisher(endpoint=taken.endpoint.replace("127.0.0.1", "*"), replay_endpoint=None)
    assert threading.active_count() == before


def test_the_factory_follows_the_config():
    assert isinstance(make_publisher(KVEventsConfig()), NullEventPublisher)
    publisher = make_publisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=LOOPBACK, topic="t"))
    try:
        assert isinstance(publisher, ZmqEventPublisher)
        assert publisher.endpoint.startswith("tcp://127.0.0.1:")
        assert publisher.replay_endpoint is None
    finally:
        publisher.close()


def test_a_connecting_endpoint_delivers_to_a_bound_subscriber(consumers):
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(LOOPBACK)
    publisher = ZmqEventPublisher(endpoint=sub.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        for _ in range(100):
            publisher.publish(removed(9))
            if sub.poll(WARM_UP_POLL_MS):
                break
        topic, seq, payload = sub.recv_multipart()
        assert (topic, len(seq), removed_hash(payload)) == (b"", 8, 9)
    finally:
        publisher.close()
        context.destroy(linger=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def events_config(**fields) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, **fields)


def test_one_address_is_bound_without_the_wildcard_and_the_log_says_who_can_reach_it(consumers, caplog):
    """``tcp://127.0.0.1:PORT`` connects by vLLM's rule (a subscriber got nothing); ``"bind"`` binds it."""
    caplog.set_level(logging.INFO, "prefixcache.kv_events")
    port = free_port()
    connecting = make_publisher(events_config(endpoint=f"tcp://127.0.0.1:{port}"))
    connecting.close()
    assert not connecting.endpoint_bound
    assert f"connecting to tcp://127.0.0.1:{port} (only a subscriber bound there receives them" in caplog.text
    publisher = make_publisher(
        events_config(endpoint=f"tcp://127.0.0.1:{port}", endpoint_mode="bind", replay_endpoint=LOOPBACK)
    )
    try:
        assert publisher.endpoint_bound and publisher.endpoint == f"tcp://127.0.0.1:{port}"
        consumer = consumers(publisher)
        first = wait_until_subscribed(publisher, consumer)
        publisher.publish(removed(7))
        assert consumer.receive()[1] == first
        assert f"bound at tcp://127.0.0.1:{port}, reachable from loopback only (this host)" in caplog.text
        assert f"replays: bound at {publisher.replay_endpoint}, reachable from loopback only" in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        publisher.close()


def test_a_wildcard_bind_warns_that_token_ids_reach_every_interface_unless_left_out(caplog):
    caplog.set_level(logging.INFO, "prefixcache.kv_events")
    for publish_token_ids in (True, False):
        caplog.clear()
        publisher = make_publisher(
            events_config(endpoint=f"tcp://*:{free_port()}", publish_token_ids=publish_token_ids)
        )
        publisher.close()
        assert "reachable from every interface" in caplog.text
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        if publish_token_ids:
            [warning] = warnings
            assert "carry the prompts' token ids to every interface" in warning and '"endpoint_mode": "bind"' in warning
        else:
            assert warnings == []


def test_an_ipc_endpoint_is_bound_for_this_host(tmp_path, consumers, caplog):
    caplog.set_level(logging.INFO, "prefixcache.kv_events")
    path = tmp_path / "events"
    publisher = make_publisher(events_config(endpoint=f"ipc://{path}"))
    try:
        consumer = consumers(publisher)
        first = wait_until_subscribed(publisher, consumer)
        publisher.publish(removed(3))
        assert consumer.receive()[1] == first
        assert f"bound at ipc://{path}, reachable from this host only" in caplog.text
    finally:
        publisher.close()


@pytest.mark.parametrize(
    ("endpoint", "who"),
    [
        ("tcp://0.0.0.0:5557", "every interface"),
        ("tcp://[::]:5557", "every interface"),
        ("tcp://[::1]:5557", "loopback only (this host)"),
        ("tcp://10.0.0.2:5557", "10.0.0.2 only (a private address)"),
        ("tcp://8.8.8.8:5557", "8.8.8.8 only (a public address, reachable from other networks)"),
        ("tcp://eth0:5557", "the interface eth0 only"),
        ("inproc://events", "this process only"),
    ],
)
def test_the_reach_of_a_bound_address(endpoint, who):
    assert reach(endpoint) == who
