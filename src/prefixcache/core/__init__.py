"""The prefix-caching KV cache manager: pure Python, importable without torch."""

from prefixcache.core.block_pool import Block, BlockPool
from prefixcache.core.eviction import EVICTION_POLICIES
from prefixcache.core.hashing import HASH_ALGOS, BlockHash, hash_block_tokens, root_hash
from prefixcache.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from prefixcache.core.miss import MISS_REASONS, EvictedHashes, PrefixLookup, hittable_blocks
from prefixcache.core.request import MultiModalFeature, Request

__all__ = [
    "EVICTION_POLICIES",
    "HASH_ALGOS",
    "MISS_REASONS",
    "Block",
    "BlockHash",
    "BlockPool",
    "EvictedHashes",
    "KVCacheManager",
    "MultiModalFeature",
    "PrefixCacheStats",
    "PrefixLookup",
    "Request",
    "hash_block_tokens",
    "hittable_blocks",
    "root_hash",
]
