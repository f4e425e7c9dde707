"""Plugging the offload tiers into an engine: the one call an engine makes, after building its parts."""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING

from prefixcache.offload.connector import OffloadConnector, TierWriter
from prefixcache.offload.disk import DiskStore
from prefixcache.offload.host import HostMemoryStore
from prefixcache.offload.record import KVLayout, model_fingerprint
from prefixcache.offload.store import KVStore
from prefixcache.offload.worker import OffloadWorker

if TYPE_CHECKING:
    from prefixcache.config import EngineConfig
    from prefixcache.engine.model_runner import ModelRunner
    from prefixcache.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


def attach_offload(
    owner: object, config: EngineConfig, scheduler: Scheduler, runner: ModelRunner, weights_digest: str
) -> OffloadConnector | None:
    """Build the tiers ``config`` asks for and connect them to ``scheduler`` and ``runner``; None without tiers.

    ``weights_digest`` (``LoadedModel.weights_digest``) identifies the model's weights in the tiers' namespace.

    The tiers are closed (queued writes finished, connections dropped) when ``owner`` is garbage-collected
    or the interpreter exits, or earlier by ``connector.close()``.
    """
    offload = config.offload_config()
    manager = scheduler.manager
    if not offload.enabled:
        return None
    if not manager.enable_caching:
        logger.warning("KV offload tiers ignored: prefix caching is off")
        return None
    model = runner.model
    model_config = model.config
    layout = KVLayout(
        model_fingerprint=model_fingerprint(model_config, weights_digest),
        dtype=config.dtype,
        block_size=manager.block_size,
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        hash_algo=manager.hash_algo,
        root_hash=manager.root_hash,
        record_key=offload.record_key,
    )
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
    connector = OffloadConnector(manager, stores, offload.mode, writer)
    scheduler.connector = connector
    runner.offload = OffloadWorker(runner.kv_caches, layout, writer)
    weakref.finalize(owner, connector.close)
    logger.info(
        "KV offload: %s, host tier %s; blocks of %.2f MiB, namespace %s; %s",
        ", ".join(f"{s.medium} {s.capacity_bytes / 2**30:.2f} GiB" for s in stores),
        offload.mode.replace("_", "-"),
        layout.block_bytes / 2**20,
        layout.namespace.hex(),
        "records checksummed, not authenticated (no --kv-offload-secret-file)"
        if offload.record_key is None
        else f"records authenticated with HMAC-SHA256, key {offload.record_key.key_id}",
    )
    return connector


def _at_least_one_block(capacity: int, layout: KVLayout, option: str) -> int:
    if capacity < layout.block_bytes:
        raise ValueError(
            f"{option} capacity of {capacity} bytes holds no block; one block takes {layout.block_bytes} bytes"
        )
    return capacity
