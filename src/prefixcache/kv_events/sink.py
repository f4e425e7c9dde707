"""The engine's whole contact with KV cache events: a collector for the pool, publish after each forward pass, close."""

from __future__ import annotations

import time
from collections.abc import Sequence

from prefixcache.core.kv_cache_groups import FULL_ATTENTION, KVCacheGroupSpec
from prefixcache.kv_events.collector import KVEventCollector
from prefixcache.kv_events.config import KVEventsConfig
from prefixcache.kv_events.events import MEDIUM_GPU, KVEventBatch
from prefixcache.kv_events.publisher import EventPublisher, make_publisher


class KVEventSink:
    """Collects one pool's events and publishes them as one batch per forward pass.

    ``collector`` is given to the cache manager as a pool listener (and to the offload tiers). The engine
    calls :meth:`publish_pending` after each forward pass (and after a cache reset), so a ``BlockStored``
    never goes out before the K/V it announces was written.
    """

    def __init__(
        self,
        config: KVEventsConfig,
        groups: Sequence[KVCacheGroupSpec] = (FULL_ATTENTION,),
        medium: str = MEDIUM_GPU,
        data_parallel_rank: int = 0,
    ) -> None:
        self.collector = KVEventCollector(medium, config.block_hash_encoding, groups, config.publish_token_ids)
        self.publisher: EventPublisher = make_publisher(config, data_parallel_rank)
        self.data_parallel_rank = data_parallel_rank

    @classmethod
    def create(cls, config: KVEventsConfig | None, groups: Sequence[KVCacheGroupSpec]) -> KVEventSink | None:
        """A sink for a pool of these KV cache groups when events are enabled, else None."""
        if config is None or not config.enable_kv_cache_events:
            return None
        return cls(config, groups)

    @property
    def num_dropped(self) -> int:
        """Batches dropped because the publisher's queue was full (a metric for the server)."""
        return self.publisher.num_dropped

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
