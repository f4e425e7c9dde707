"""Publishing event batches over ZeroMQ the way vLLM does, without ever blocking the engine step.

Each batch goes out on a PUB socket as three frames: topic, sequence number (8-byte big-endian, from
0) and the msgpack payload. A ROUTER socket serves replays: a request ``[identity, "", start_seq]``
gets ``[identity, "", seq, payload]`` for every buffered batch with ``seq >= start_seq``, then the end
marker ``[identity, "", -1 as 8 signed bytes, ""]``. A batch dropped because the queue was full still
uses up its sequence number, so consumers see the gap (and that replay cannot fill it: resync).

The payloads carry block hashes and, unless ``publish_token_ids`` is off, the prompts' token ids: whoever
can read the sockets reads what every tenant sends. So the factory logs at start-up where each socket is
bound or what it connects to, and who can reach it, and warns when token ids go to every interface.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import queue
import threading
from collections import deque

import msgspec
import zmq

from prefixcache.kv_events.config import KVEventsConfig, binds
from prefixcache.kv_events.events import EventBatch

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# How long the publisher thread waits for a batch before it looks at replay requests and close() again.
POLL_INTERVAL_S = 0.05


class NullEventPublisher:
    """Publisher ``"null"``: events are collected but go nowhere."""

    num_dropped = 0

    def publish(self, batch: EventBatch) -> None:
        """Discard ``batch``."""

    def close(self) -> None:
        """Nothing to release."""


def _tcp_host(endpoint: str) -> str | None:
    """The host of a tcp:// address without IPv6 brackets (``*`` for the wildcard); None for other schemes."""
    scheme, _, address = endpoint.partition("://")
    return address.rpartition(":")[0].strip("[]") if scheme == "tcp" else None


def reach(endpoint: str) -> str:
    """Who can reach a bound endpoint (as resolved: ``tcp://*:5557`` reads ``tcp://0.0.0.0:5557``)."""
    scheme, _, address = endpoint.partition("://")
    if scheme == "inproc":
        return "this process only"
    if scheme == "ipc":
        return f"this host only, as far as the permissions of {address} allow"
    host = _tcp_host(endpoint) or ""
    if host == "*":
        return "every interface"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"the interface {host} only"
    if ip.is_unspecified:
        return "every interface"
    if ip.is_loopback:
        return "loopback only (this host)"
    if ip.is_private:
        return f"{ip} only (a private address)"
    return f"{ip} only (a public address, reachable from other networks)"


def exposed(endpoint: str) -> bool:
    """Whether a bound endpoint can be read from other networks: every interface, or a public address."""
    host = _tcp_host(endpoint)
    if host is None:
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host == "*"
    return ip.is_unspecified or ip.is_global


def _open_socket(
    context: zmq.Context, kind: int, endpoint: str, bind: bool, hwm: int | None = None
) -> tuple[zmq.Socket, str]:
    """A socket bound to ``endpoint`` or connected to it; returns it and its resolved address."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if hwm is not None:
        sock.set_hwm(hwm)
    if ":" in (_tcp_host(endpoint) or ""):
        sock.setsockopt(zmq.IPV6, 1)
    try:
        if bind:
            sock.bind(endpoint)
            return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
        sock.connect(endpoint)
        return sock, endpoint
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise ValueError(f"cannot open KV events endpoint {endpoint!r}: {exc}") from exc


class ZmqEventPublisher:
    """vLLM-compatible PUB publisher with a replay buffer, fed by one thread (the engine's).

    ``publish`` only numbers the batch and puts it on a bounded queue; a background thread encodes and
    sends it, keeps the last ``buffer_steps`` payloads and answers replays. When ``max_queue_size``
    batches are waiting, new ones are dropped and counted in ``num_dropped``.
    ``endpoint`` / ``replay_endpoint`` hold the resolved addresses (``tcp://127.0.0.1:*`` picks a free port);
    ``endpoint_bound`` says whether ``endpoint`` was bound (``endpoint_mode``, as in ``KVEventsConfig``).
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        data_parallel_rank: int = 0,
        endpoint_mode: str = "auto",
    ) -> None:
        self.data_parallel_rank = data_parallel_rank
        self.endpoint_bound = binds(endpoint, endpoint_mode)
        self.num_dropped = 0
        self._topic = topic.encode()
        self._queue: queue.Queue[tuple[int, EventBatch] | None] = queue.Queue(max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._next_seq = 0
        self._closed = False
        self._stop = threading.Event()
        self._context = zmq.Context()
        self._replay: zmq.Socket | None = None
        try:
            self._pub, self.endpoint = _open_socket(self._context, zmq.PUB, endpoint, self.endpoint_bound, hwm)
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay, self.replay_endpoint = _open_socket(self._context, zmq.ROUTER, replay_endpoint, True)
        except ValueError:
            self._context.destroy(linger=0)
            raise
        # The sockets belong to the thread from here on (starting it is the memory barrier zmq asks for).
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will get: every batch so far, sent or dropped."""
        return self._next_seq

    def publish(self, batch: EventBatch) -> None:
        """Queue ``batch`` under the next sequence number; never blocks. Single producer only."""
        if self._closed:
            raise RuntimeError("the KV event publisher is closed")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.num_dropped += 1

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        with contextlib.suppress(queue.Full):  # when full, the thread drains the queue, then sees the stop flag
            self._queue.put_nowait(None)
        self._thread.join()
        self._context.term()

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay()
                try:
                    item = self._queue.get(timeout=POLL_INTERVAL_S)
                except queue.Empty:
                    if self._stop.is_set():
                        return
                    continue
                if item is None:
                    return
                self._send(*item)
        except Exception:
            logger.exception("KV event publisher thread failed; events are no longer published")
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _send(self, seq: int, batch: EventBatch) -> None:
        """Encode, publish and keep for replay (publisher thread only)."""
        payload = self._encoder.encode(batch)
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("ignoring a KV event replay request of %d frames (want identity, '', start)", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))


EventPublisher = NullEventPublisher | ZmqEventPublisher


def make_publisher(config: KVEventsConfig, data_parallel_rank: int = 0) -> EventPublisher:
    """The publisher ``config.publisher`` names; a ZeroMQ one logs where it publishes and who can read it."""
    if config.publisher == "null":
        return NullEventPublisher()
    publisher = ZmqEventPublisher(
        endpoint=config.endpoint,
        replay_endpoint=config.replay_endpoint,
        buffer_steps=config.buffer_steps,
        hwm=config.hwm,
        max_queue_size=config.max_queue_size,
        topic=config.topic,
        data_parallel_rank=data_parallel_rank,
        endpoint_mode=config.endpoint_mode,
    )
    if publisher.endpoint_bound:
        logger.info("KV events: bound at %s, reachable from %s", publisher.endpoint, reach(publisher.endpoint))
    else:
        logger.info(
            "KV events: connecting to %s (only a subscriber bound there receives them; bind one address with "
            '"endpoint_mode": "bind")',
            publisher.endpoint,
        )
    bound = [publisher.endpoint] if publisher.endpoint_bound else []
    if publisher.replay_endpoint is not None:
        logger.info(
            "KV event replays: bound at %s, reachable from %s",
            publisher.replay_endpoint,
            reach(publisher.replay_endpoint),
        )
        bound.append(publisher.replay_endpoint)
    for endpoint in bound:
        if config.publish_token_ids and exposed(endpoint):
            logger.warning(
                "KV events at %s carry the prompts' token ids to %s: whoever reaches the port reads what every "
                'tenant sends. Bind one private or loopback address ("endpoint_mode": "bind", e.g. '
                'tcp://10.0.0.2:5557), use ipc:// on one host, or set "publish_token_ids": false',
                endpoint,
                reach(endpoint),
            )
    return publisher
