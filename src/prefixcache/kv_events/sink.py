"""The engine's whole contact with KV cache events: attach to the pool, publish after each forward pass, close."""

from __future__ import annotations

import time

from prefixcache.core.block_pool import BlockPool
from prefixcache.kv_events.collector import KVEventCollector
from prefixcache.kv_events.config import KVEventsConfig
from prefixcache.kv_events.events import MEDIUM_GPU, KVEventBatch
from prefixcache.kv_events.publisher import EventPublisher, make_publisher


class KVEventSink:
    """Collects one pool's events and publishes them as one batch per forward pass.

    The engine calls :meth:`publish_pending` after each forward pass (and after a cache reset), so a
    ``BlockStored`` never goes out before the K/V it announces was written.
    """

    def __init__(self, config: KVEventsConfig, medium: str = MEDIUM_GPU, data_parallel_rank: int = 0) -> None:
        self.collector = KVEventCollector(medium, config.block_hash_encoding, config.publish_token_ids)
        self.publisher: EventPublisher = make_publisher(config, data_parallel_rank)
        self.data_parallel_rank = data_parallel_rank

    @classmethod
    def create(cls, config: KVEventsConfig | None, pool: BlockPool) -> KVEventSink | None:
        """A sink attached to ``pool`` when events are enabled, else None."""
        if config is None or not config.enable_kv_cache_events:
            return None
        sink = cls(config)
        sink.attach(pool)
        return sink

    @property
    def num_dropped(self) -> int:
        """Batches dropped because the publisher's queue was full (a metric for the server)."""
        return self.publisher.num_dropped

    def attach(self, pool: BlockPool) -> None:
        pool.add_listener(self.collector)

    def publish_pending(self) -> None:
        """Publish the events collected since the last call as one batch; nothing when there are none."""
        events = self.collector.take()
        if events:
            self.publisher.publish(
                KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank)
            )

    def close(self) -> None:
        """Publish what is pending, then stop the publisher."""
        self.publish_pending()
        self.publisher.close()
