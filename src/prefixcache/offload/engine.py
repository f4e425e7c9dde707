"""Building the offload tiers for an engine: the connector its cache manager gets, and what its worker needs."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixcache.core.kv_cache_groups import KVCacheGroupSpec
from prefixcache.offload.connector import WRITE_BACK, WRITE_THROUGH, OffloadConnector, TierWriter
from prefixcache.offload.disk import DiskStore
from prefixcache.offload.host import HostMemoryStore
from prefixcache.offload.record import KVLayout, model_fingerprint
from prefixcache.offload.store import KVStore, TierEventListener

if TYPE_CHECKING:
    from prefixcache.config import EngineConfig
    from prefixcache.model import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OffloadTiers:
    """The tiers of one engine: ``connector`` for its cache manager; ``layout`` and ``writer`` for the
    :class:`~prefixcache.offload.worker.OffloadWorker` its model runner gets."""

    connector: OffloadConnector
    layout: KVLayout
    writer: TierWriter


def build_offload(
    owner: object,
    config: EngineConfig,
    model_config: ModelConfig,
    weights_digest: str,
    root_hash: bytes,
    groups: Sequence[KVCacheGroupSpec],
    enable_caching: bool,
    tier_listeners: Sequence[TierEventListener] = (),
    state_bytes: int = 0,
) -> OffloadTiers | None:
    """The tiers ``config`` asks for, None without tiers (or with prefix caching off).

    ``weights_digest`` (``LoadedModel.weights_digest``) identifies the model's weights in the tiers' namespace.
    With more than one attention KV cache group the host tier is filled write-through (see
    :mod:`prefixcache.offload.connector`); a model with recurrent layers (its recurrent-state group last in
    ``groups``) stores its state checkpoints too, ``state_bytes`` each. The tiers are closed (queued writes
    finished, connections dropped) when ``owner`` is garbage-collected or the interpreter exits, or earlier by
    ``connector.close()``.
    """
    offload = config.offload_config()
    if not offload.enabled:
        return None
    if not enable_caching:
        logger.warning("KV offload tiers ignored: prefix caching is off")
        return None
    layout = KVLayout(
        model_fingerprint=model_fingerprint(model_config, weights_digest),
        dtype=config.dtype,
        block_size=config.block_size,
        num_layers=len(model_config.attention_layers),
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        hash_algo=config.hash_algo,
        root_hash=root_hash,
        record_key=offload.record_key,
        state_bytes=state_bytes,
    )
    groups = [group for group in groups if not group.recurrent_state]  # checkpoints are no blocks
    mode = offload.mode
    if mode == WRITE_BACK and len(groups) > 1:
        logger.warning(
            "KV offload: the host tier is filled write-through, not write-back: the KV cache has %d groups "
            "(sliding-window layers give blocks back before the full-attention layers evict theirs)",
            len(groups),
        )
        mode = WRITE_THROUGH
    stores: list[KVStore] = []
    if offload.cpu_bytes is not None:
        stores.append(HostMemoryStore(layout, _at_least_one_block(offload.cpu_bytes, layout, "kv_offload_cpu")))
    if offload.disk_path is not None:
        stores.append(DiskStore(layout, offload.disk_path, _at_least_one_block(offload.disk_bytes, layout, "disk")))
    if offload.redis_url is not None:
        from prefixcache.offload.redis_store import RedisStore

        capacity = _at_least_one_block(offload.redis_bytes, layout, "redis")
        stores.append(RedisStore(layout, offload.redis_url, capacity, password=offload.redis_password))
    writer = TierWriter(stores)
    connector = OffloadConnector(
        stores, config.block_size, mode, writer, groups, tier_listeners, min_priority=offload.min_priority
    )
    weakref.finalize(owner, connector.close)
    logger.info(
        "KV offload: %s, host tier %s%s; blocks of %.2f MiB, namespace %s; %s",
        ", ".join(f"{s.medium} {s.capacity_bytes / 2**30:.2f} GiB" for s in stores),
        mode.replace("_", "-"),
        f", blocks below priority {offload.min_priority} dropped" if offload.min_priority else "",
        layout.block_bytes / 2**20,
        layout.namespace.hex(),
        "records checksummed, not authenticated (no --kv-offload-secret-file)"
        if offload.record_key is None
        else f"records authenticated with HMAC-SHA256, key {offload.record_key.key_id}",
    )
    return OffloadTiers(connector, layout, writer)


def _at_least_one_block(capacity: int, layout: KVLayout, option: str) -> int:
    if capacity < layout.block_bytes:
        raise ValueError(
            f"{option} capacity of {capacity} bytes holds no block; one block takes {layout.block_bytes} bytes"
        )
    return capacity
