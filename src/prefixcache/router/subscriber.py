"""Keeps one backend's entries in the router's index in step with the KV events it publishes.

On start it subscribes, then asks the replay socket for everything buffered (so a router started
after the backend learns what is cached already). Each batch must carry the next sequence number:

- a gap (batches lost to a full queue or the network) is filled by a replay from the first missing one;
  what the replay cannot return any more is counted as dropped;
- a sequence number already seen is a duplicate when its timestamp is not newer than the last batch
  applied (a replay overlapping the live feed), otherwise the publisher restarted: the backend's
  entries are dropped and rebuilt from its replay;
- ``AllBlocksCleared`` (a reset of the engine's own cache) drops the backend's ``GPU`` entries; what its
  offload tiers hold stays.

Everything runs on the router's event loop, as does routing, so the index needs no lock.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import zmq
import zmq.asyncio

from prefixcache.router.index import PrefixIndex
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
    external_block_hash,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EventSource:
    """Addresses to connect to (not the backend's bind addresses)."""

    endpoint: str
    replay_endpoint: str | None
    topic: str


class EventSubscriber:
    def __init__(
        self,
        backend: str,
        source: EventSource,
        index: PrefixIndex,
        metrics: RouterMetrics,
        context: zmq.asyncio.Context,
        replay_timeout: float = 5.0,
    ) -> None:
        self.backend = backend
        self.source = source
        self.index = index
        self.metrics = metrics
        self.context = context
        self.replay_timeout = replay_timeout
        self.next_seq: int | None = None
        self.last_ts = float("-inf")
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
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    logger.warning("%s: KV event message of %d frames, not 3; ignored", self.backend, len(frames))
                    continue
                decoded = self._decode(frames[1], frames[2])
                if decoded is not None:
                    await self.deliver(*decoded)
        except Exception:
            logger.exception("%s: KV event subscriber failed; the backend is routed by load from now on", self.backend)
            self.index.clear(self.backend)
            raise
        finally:
            sub.close()

    async def deliver(self, seq: int, batch: KVEventBatch) -> None:
        """Apply one live batch, replaying first whatever its sequence number says was missed."""
        if self.next_seq is not None and seq < self.next_seq:
            if seq != 0 and batch.ts <= self.last_ts:
                return
            logger.info("%s: KV event sequence restarted at %d; resyncing", self.backend, seq)
            self.resync()
        if self.source.replay_endpoint is not None and seq > (self.next_seq or 0):
            await self._replay(self.next_seq or 0)
            if self.next_seq is not None and seq < self.next_seq:
                return
        self._apply(seq, batch)

    def resync(self) -> None:
        """Forget the backend's entries and the sequence: the next batch starts a fresh picture."""
        self.index.clear(self.backend)
        self.next_seq = None
        self.last_ts = float("-inf")
        self.metrics.resyncs.labels(self.backend).inc()

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        if self.next_seq is not None and seq > self.next_seq:
            self.metrics.batches_dropped.labels(self.backend).inc(seq - self.next_seq)
            logger.warning("%s: KV event batches %d..%d are lost", self.backend, self.next_seq, seq - 1)
        index, backend = self.index, self.backend
        for event in batch.events:
            if isinstance(event, BlockStored):
                index.store(backend, map(external_block_hash, event.block_hashes), event.medium or MEDIUM_GPU)
            elif isinstance(event, BlockRemoved):
                index.remove(backend, map(external_block_hash, event.block_hashes), event.medium or MEDIUM_GPU)
            elif isinstance(event, AllBlocksCleared):
                index.clear(backend, MEDIUM_GPU)
        self.metrics.events_received.labels(backend).inc(len(batch.events))
        self.next_seq = seq + 1
        self.last_ts = max(self.last_ts, batch.ts)

    async def _replay(self, start: int) -> None:
        """Apply every buffered batch from ``start`` on; gives up (and counts the loss) on silence."""
        self.metrics.replays.labels(self.backend).inc()
        dealer = self.context.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(self.source.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(int(self.replay_timeout * 1000)):
                    logger.warning("%s: no answer to a KV event replay from %d", self.backend, start)
                    return
                frames = await dealer.recv_multipart()
                if len(frames) != 3:
                    logger.warning("%s: replay message with %d frames, expected 3", self.backend, len(frames))
                    continue
                if decode_seq(frames[1]) == END_OF_REPLAY:
                    return
                decoded = self._decode(frames[1], frames[2])
                if decoded is None or (self.next_seq is not None and decoded[0] < self.next_seq):
                    continue
                if self.next_seq is None and decoded[0] > start:  # the buffer no longer reaches back to start
                    self.metrics.batches_dropped.labels(self.backend).inc(decoded[0] - start)
                self._apply(*decoded)
        finally:
            dealer.close()

    def _decode(self, seq_frame: bytes, payload: bytes) -> tuple[int, KVEventBatch] | None:
        try:
            return decode_seq(seq_frame), decode_batch(payload)
        except ValueError as exc:
            logger.warning("%s: undecodable KV event batch ignored: %s", self.backend, exc)
            return None
