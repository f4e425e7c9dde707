"""The prefix-caching KV cache manager: pure Python, importable without torch."""

from prefixcache.core.block_pool import Block, BlockPool
from prefixcache.core.eviction import EVICTION_POLICIES
from prefixcache.core.hashing import HASH_ALGOS, BlockHash, hash_block_tokens, root_hash
from prefixcache.core.kv_cache_groups import FULL_ATTENTION, KVCacheGroupSpec, longest_common_hit
from prefixcache.core.kv_cache_manager import KVCacheManager, KVConnector, PrefixCacheStats, PrefixHit
from prefixcache.core.miss import MISS_REASONS, EvictedHashes, PrefixLookup, hittable_blocks
from prefixcache.core.request import MultiModalFeature, Request
from prefixcache.core.retention import DEFAULT_PRIORITY, RetentionRange

__all__ = [
    "DEFAULT_PRIORITY",
    "EVICTION_POLICIES",
    "FULL_ATTENTION",
    "HASH_ALGOS",
    "MISS_REASONS",
    "Block",
    "BlockHash",
    "BlockPool",
    "EvictedHashes",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVConnector",
    "MultiModalFeature",
    "PrefixCacheStats",
    "PrefixHit",
    "PrefixLookup",
    "Request",
    "RetentionRange",
    "hash_block_tokens",
    "hittable_blocks",
    "longest_common_hit",
    "root_hash",
]
