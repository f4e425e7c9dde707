"""Consumers of the event stream on loopback, and engines that publish to them."""

import pytest
import zmq

from prefixcache.engine import LLM
from tests.kv_events.vllm_wire import END_SEQ, KVEventBatch, decoder

WAIT_MS = 10_000  # an upper bound on waiting for a message, never a measured duration
LOOPBACK = "tcp://127.0.0.1:*"
REPLAY_ATTEMPTS = 200  # each waits for the publisher thread's next turn


class EventConsumer:
    """A SUB socket for live batches and a DEALER for replays, as a router would hold them."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: bytes = b"") -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_socket = None
        if replay_endpoint is not None:
            self.replay_socket = self.context.socket(zmq.DEALER)
            self.replay_socket.setsockopt(zmq.LINGER, 0)
            self.replay_socket.connect(replay_endpoint)

    def receive(self, timeout_ms: int = WAIT_MS) -> tuple[bytes, int, bytes] | None:
        """``(topic, seq, payload)`` of the next live message, None when none came in ``timeout_ms``."""
        if not self.sub.poll(timeout_ms):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big"), payload

    def replay(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Every buffered ``(seq, payload)`` from ``start_seq``, read up to the end marker."""
        self.replay_socket.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out = []
        while True:
            assert self.replay_socket.poll(WAIT_MS), "no end-of-replay marker"
            empty, seq, payload = self.replay_socket.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))

    def replay_batches(self, start_seq: int = 0) -> list[tuple[int, KVEventBatch]]:
        return [(seq, decoder.decode(payload)) for seq, payload in self.replay(start_seq)]

    def replay_through(self, last_seq: int) -> list[tuple[int, KVEventBatch]]:
        """Every buffered batch, once the publisher thread has sent ``last_seq`` (publishing is asynchronous)."""
        for _ in range(REPLAY_ATTEMPTS):
            batches = self.replay_batches(0)
            if batches and batches[-1][0] >= last_seq:
                return batches
        raise AssertionError(f"batch {last_seq} was never sent")

    def close(self) -> None:
        self.context.destroy(linger=0)


@pytest.fixture
def consumers():
    """``connect(publisher)`` gives a consumer of that publisher's endpoints; all are closed at the end."""
    made: list[EventConsumer] = []

    def connect(publisher, topic: bytes = b"") -> EventConsumer:
        consumer = EventConsumer(publisher.endpoint, publisher.replay_endpoint, topic)
        made.append(consumer)
        return consumer

    yield connect
    for consumer in made:
        consumer.close()


@pytest.fixture
def make_llm(make_llm):
    """The shared factory (tests/conftest.py: closed, publisher thread reaped) publishing events on free loopback
    ports, with 64 blocks."""

    def make(**config) -> LLM:
        events = {"enable_kv_cache_events": True, "endpoint": LOOPBACK, "replay_endpoint": LOOPBACK}
        events |= config.pop("events", {})
        config.setdefault("num_blocks", 64)
        return make_llm(kv_events_config=events, **config)

    return make
