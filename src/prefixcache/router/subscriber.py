"""Keeps one backend's entries in the router's index in step with the KV events it publishes.

On start it subscribes, then asks the replay socket for everything buffered (so a router started
after the backend learns what is cached already). Each batch must carry the next sequence number:

- a gap (batches lost to a full queue or the network) is filled by a replay from the first missing one;
  what the replay cannot return any more is counted as dropped;
- a sequence number already seen is a duplicate when it is the very batch applied under that number (a
  replay overlapping the live feed: same number, same timestamp), otherwise the publisher restarted: the
  backend's entries are dropped and rebuilt from its replay;
- ``AllBlocksCleared`` (a reset of the engine's own cache) drops the backend's ``GPU`` entries; what its
  offload tiers hold stays.

Whatever arrives is input from the network, so nothing it holds may end the subscriber or poison its
state. A message of the wrong shape, an undecodable payload or event, a sequence frame that is not 8
bytes, a live sequence number the publisher's own replay does not hold (a forged or corrupt one), or a
jump of more than ``MAX_SEQUENCE_GAP`` batches that the next batch does not confirm: each is dropped and
counted in ``bad_event_messages`` by reason, logged the first time. Events that say the backend stores
blocks of another size than the router hashes refuse the backend (``on_refused``).

Everything runs on the router's event loop, as does routing, so the index needs no lock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from prefixcache.router.blocks import BadEventError, EngineKeyedBlocks, EventsRefusedError
from prefixcache.router.metrics import RouterMetrics
from prefixcache.router.wire import (
    END_OF_REPLAY,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    decode_seq,
    replay_reply,
)

logger = logging.getLogger(__name__)

# A real gap is the batches published while the router was not listening: 2**32 of them is over a year of
# engine steps. A larger jump is believed only when the next batch follows it.
MAX_SEQUENCE_GAP = 1 << 32
# Batches remembered by number and timestamp, to tell a replayed copy from a restarted publisher.
RECENT_BATCHES = 4096


@dataclass(frozen=True, slots=True)
class EventSource:
    """Addresses to connect to (not the backend's bind addresses)."""

    endpoint: str
    replay_endpoint: str | None
    topic: str = ""


class EventSubscriber:
    def __init__(
        self,
        backend: str,
        source: EventSource,
        blocks: EngineKeyedBlocks,
        metrics: RouterMetrics,
        context: zmq.asyncio.Context,
        replay_timeout: float = 5.0,
        on_refused: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.backend = backend
        self.source = source
        self.blocks = blocks
        self.metrics = metrics
        self.context = context
        self.replay_timeout = replay_timeout
        self.on_refused = on_refused
        self.next_seq: int | None = None
        self.batches_applied = 0
        self._recent: dict[int, float] = {}  # seq -> ts of the last RECENT_BATCHES batches applied
        self._jump: int | None = None  # a sequence number past MAX_SEQUENCE_GAP, believed if the next follows it
        self._reported: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-events {self.backend}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.linger = 0
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        sub.connect(self.source.endpoint)
        try:
            if self.source.replay_endpoint is not None:
                await self._replay(0)
            while True:
                await self.receive(await sub.recv_multipart())
        except EventsRefusedError as exc:
            self.blocks.clear()
            self.on_refused(str(exc))
        finally:
            sub.close()

    async def receive(self, frames: list[bytes]) -> None:
        """One live message. Only EventsRefusedError leaves: anything else is bad input, or a resync."""
        try:
            if len(frames) != 3:
                self._bad("frames", f"a message of {len(frames)} frames, not 3 (topic, sequence, payload)")
                return
            decoded = self._decode(frames[1], frames[2])
            if decoded is not None:
                await self.deliver(*decoded)
        except EventsRefusedError:
            raise
        except Exception:  # a defect here must not leave the backend unsubscribed for good
            logger.exception("%s: a KV event message could not be applied; resyncing", self.backend)
            self.resync()

    async def deliver(self, seq: int, batch: KVEventBatch) -> None:
        """Apply one live batch, replaying first whatever its sequence number says was missed."""
        if self.next_seq is not None and seq < self.next_seq:
            if self._recent.get(seq) == batch.ts:
                return
            logger.info("%s: KV event sequence restarted at %d; resyncing", self.backend, seq)
            self.resync()
        expected = self.next_seq or 0
        if self.source.replay_endpoint is not None and seq > expected:
            reached = await self._replay(expected)
            if self.next_seq is not None and seq < self.next_seq:
                return
            if reached is not None and reached < seq:
                self._bad("sequence", f"batch {seq} is not in the publisher's replay, which ends at {reached}")
                return
        if self._plausible(seq):
            self._apply(seq, batch)

    def resync(self) -> None:
        """Forget the backend's entries and the sequence: the next batch starts a fresh picture."""
        self.blocks.clear()
        self.next_seq = None
        self._recent.clear()
        self.metrics.resyncs.labels(self.backend).inc()

    def _plausible(self, seq: int, base: int | None = None) -> bool:
        """Whether ``seq`` is within MAX_SEQUENCE_GAP of the next expected one (``base`` when none is)."""
        base = self.next_seq if self.next_seq is not None else base
        if base is None or seq - base <= MAX_SEQUENCE_GAP:
            self._jump = None
            return True
        if self._jump is not None and seq == self._jump + 1:
            logger.warning("%s: KV event sequence jumped to %d and went on from there; resyncing", self.backend, seq)
            self._jump = None
            self.resync()
            return True
        self._jump = seq
        self._bad("sequence", f"batch {seq} is {seq - base} past the next expected one ({base})")
        return False

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        if self.next_seq is not None and seq > self.next_seq:
            self.metrics.batches_dropped.labels(self.backend).inc(seq - self.next_seq)
            logger.warning("%s: KV event batches %d..%d are lost", self.backend, self.next_seq, seq - 1)
        for event in batch.events:
            try:
                if isinstance(event, BlockStored):
                    self.blocks.store(event)
                elif isinstance(event, BlockRemoved):
                    self.blocks.remove(event)
                elif isinstance(event, AllBlocksCleared):
                    self.blocks.clear(MEDIUM_GPU)
            except BadEventError as exc:
                self._bad("event", f"{type(event).__name__}: {exc}")
        self.metrics.events_received.labels(self.backend).inc(len(batch.events))
        self.batches_applied += 1
        self.next_seq = seq + 1
        self._recent[seq] = batch.ts
        if len(self._recent) > RECENT_BATCHES:
            del self._recent[next(iter(self._recent))]

    async def _replay(self, start: int) -> int | None:
        """Apply every buffered batch from ``start`` on. Returns the highest sequence number the replay held
        (``start - 1`` when none), or None when it did not answer (counted as a loss by the next gap)."""
        self.metrics.replays.labels(self.backend).inc()
        dealer = self.context.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(self.source.replay_endpoint)
        highest = start - 1
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(int(self.replay_timeout * 1000)):
                    logger.warning("%s: no answer to a KV event replay from %d", self.backend, start)
                    return None
                frames = await dealer.recv_multipart()
                reply = replay_reply(frames)
                if reply is None:
                    self._bad("frames", f"a replay reply of {len(frames)} frames, not ['', (topic,) sequence, payload]")
                    continue
                if _is_end_of_replay(reply[0]):
                    return highest
                decoded = self._decode(*reply)
                if decoded is None:
                    continue
                seq, batch = decoded
                highest = max(highest, seq)
                if self.next_seq is not None and seq < self.next_seq:
                    continue
                if not self._plausible(seq, start):
                    continue
                if self.next_seq is None and seq > start:  # the buffer no longer reaches back to start
                    self.metrics.batches_dropped.labels(self.backend).inc(seq - start)
                self._apply(seq, batch)
        finally:
            dealer.close()

    def _decode(self, seq_frame: bytes, payload: bytes) -> tuple[int, KVEventBatch] | None:
        try:
            seq = decode_seq(seq_frame)
        except ValueError as exc:
            self._bad("sequence", str(exc))
            return None
        if seq < 0:
            self._bad("sequence", f"sequence number {seq + (1 << 64)} is past 2**63")
            return None
        try:
            return seq, decode_batch(payload)
        except ValueError as exc:
            self._bad("payload", f"undecodable KV event batch: {exc}")
            return None

    def _bad(self, reason: str, detail: str) -> None:
        self.metrics.bad_event_messages.labels(self.backend, reason).inc()
        if reason not in self._reported:
            self._reported.add(reason)
            logger.warning(
                "%s: KV event input dropped (%s); further ones are counted in "
                "prefixcache:router_bad_event_messages_total{reason=%r}",
                self.backend,
                detail,
                reason,
            )


def _is_end_of_replay(seq_frame: bytes) -> bool:
    try:
        return decode_seq(seq_frame) == END_OF_REPLAY
    except ValueError:
        return False
