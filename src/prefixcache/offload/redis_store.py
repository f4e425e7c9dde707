"""The Redis tier: blocks shared by every engine that talks to one Redis, with the disk tier's records.

Keys, for a layout's namespace ``NS`` (hex): ``prefixcache:NS:kv:<block hash hex>`` hold records (header,
checksum, payload, as on disk); ``prefixcache:NS:lru`` is a sorted set of block keys by last use,
``prefixcache:NS:sizes`` a hash of the bytes written for each, ``prefixcache:NS:bytes`` their sum and
``prefixcache:NS:clock`` a counter every use increments, so engines on several hosts keep one LRU order
without agreeing on time. A block kept under a retention directive is ranked by its priority in that set
(lowest evicted first, LRU within), its key expires with it (Redis's own key expiry, at the wall-clock time its
record names) and ``prefixcache:NS:expiry`` lists such keys by expiry, so a write first gives back the bytes of
the expired ones. Lua scripts make each lookup (read
the longest run of present blocks and touch them, or only count them) and each write (store, then evict
the least recently used beyond the capacity) one atomic round trip. Engines with another layout use other
keys.

Redis down, at start or mid-run, marks the tier unavailable: lookups miss and writes are dropped at once,
and a reconnection is tried after a backoff that doubles up to ``retry_max_s``; when Redis answers again
the tier is used again.

The URL says how to connect: ``redis://USER:PASSWORD@...`` authenticates (an ACL user, or the
``requirepass`` password with an empty user), ``rediss://`` speaks TLS with redis-py's ``ssl_*`` options
(``ssl_ca_certs``, ``ssl_certfile``...); logs show the URL without its passwords.

A record that fails its check is deleted and counts as a miss, and so does a block key that holds no record
(an empty string, or a list or hash written there by something else): it is deleted when read and replaced
when written, so no prefix stays uncached for good.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from prefixcache.core.hashing import BlockHash
from prefixcache.core.retention import DEFAULT_PRIORITY
from prefixcache.offload.config import redacted_url
from prefixcache.offload.record import (
    BadRecord,
    KVLayout,
    RecordError,
    RecordRetention,
    decode_record,
    encode_record,
    record_retention,
)
from prefixcache.offload.store import KVStore

logger = logging.getLogger(__name__)
T = TypeVar("T")
NOT_A_RECORD = BadRecord(RecordError.CORRUPT, "the key holds no record (an empty value, or another type than a string)")

# A block's score in the LRU set is its rank, its priority less the default, times RANK, plus the use counter:
# the lowest priority goes first, least recently used within one, and a block at the default priority has
# the plain counter as score (what the set held before priorities existed). Lua 5.1 prints numbers with 14
# digits, so scores are formatted with '%.0f'.
RANK = 2**40
_SCORE = f"""
local RANK = {RANK}
local function score(rank, counter)
  return string.format('%.0f', rank * RANK + counter)
end
"""

# Deletes one block key, whatever it holds, and gives back the bytes stored for it (the sizes hash records
# what each store wrote, so a value altered or replaced by another type cannot skew the byte count).
# Returns the bytes used afterwards.
_DROP = """
local function drop(lru, bytes, sizes, expiry, key)
  local size = tonumber(redis.call('HGET', sizes, key) or '0')
  redis.call('DEL', key)
  redis.call('ZREM', lru, key)
  redis.call('ZREM', expiry, key)
  redis.call('HDEL', sizes, key)
  return redis.call('DECRBY', bytes, size)
end
"""

# KEYS: lru, clock, block keys in order. Returns the values of the longest run of present keys, touched (at
# their priority); a key that holds another type than a string ends the run with false (nil to the client:
# not a record).
_LOAD = (
    _SCORE
    + """
local out = {}
for i = 3, #KEYS do
  local kind = redis.call('TYPE', KEYS[i]).ok
  if kind == 'none' then break end
  if kind ~= 'string' then
    out[#out + 1] = false
    break
  end
  out[#out + 1] = redis.call('GET', KEYS[i])
  local rank = math.floor(tonumber(redis.call('ZSCORE', KEYS[1], KEYS[i]) or '0') / RANK)
  redis.call('ZADD', KEYS[1], 'XX', score(rank, redis.call('INCR', KEYS[2])), KEYS[i])
end
return out
"""
)

# KEYS: block keys in order. Returns how many of them, from the first, are present; touches nothing.
_HELD = """
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return i - 1 end
end
return #KEYS
"""

# KEYS: lru, bytes, clock, sizes, expiry, block keys; ARGV: capacity, now (Unix ms), then for each block key
# its value, rank and expiry (Unix ms, 0: none). First drops the blocks whose expiry passed (Redis may have
# deleted their keys already; their bytes are given back here). Stores the keys not present (a value larger
# than the capacity is skipped), a retained one with its key expiring when the block does; a key that holds no
# record (an empty string or another type) is dropped and stored again. Then evicts by score beyond the
# capacity. Returns {stored keys, evicted keys, bytes used, blocks held, keys that held no record}.
_STORE = (
    _SCORE
    + _DROP
    + """
local capacity = tonumber(ARGV[1])
local total = tonumber(redis.call('GET', KEYS[2]) or '0')
local stored, evicted, replaced = {}, {}, {}
for _, key in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', ARGV[2])) do
  total = drop(KEYS[1], KEYS[2], KEYS[4], KEYS[5], key)
  evicted[#evicted + 1] = key
end
for i = 6, #KEYS do
  local j = 3 + (i - 6) * 3
  local value, rank, expires = ARGV[j], tonumber(ARGV[j + 1]), ARGV[j + 2]
  local kind = redis.call('TYPE', KEYS[i]).ok
  if kind ~= 'none' and (kind ~= 'string' or redis.call('STRLEN', KEYS[i]) == 0) then
    total = drop(KEYS[1], KEYS[2], KEYS[4], KEYS[5], KEYS[i])
    replaced[#replaced + 1] = KEYS[i]
    kind = 'none'
  elseif kind == 'none' and redis.call('HEXISTS', KEYS[4], KEYS[i]) == 1 then
    total = drop(KEYS[1], KEYS[2], KEYS[4], KEYS[5], KEYS[i])  -- Redis expired it before we swept it
  end
  if kind == 'none' and string.len(value) <= capacity then
    redis.call('SET', KEYS[i], value)
    if expires ~= '0' then
      redis.call('PEXPIREAT', KEYS[i], expires)
      redis.call('ZADD', KEYS[5], expires, KEYS[i])
    end
    redis.call('ZADD', KEYS[1], score(rank, redis.call('INCR', KEYS[3])), KEYS[i])
    redis.call('HSET', KEYS[4], KEYS[i], string.len(value))
    total = redis.call('INCRBY', KEYS[2], string.len(value))
    stored[#stored + 1] = KEYS[i]
  end
end
while total > capacity do
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0)
  if #oldest == 0 then
    redis.call('SET', KEYS[2], 0)
    total = 0
    break
  end
  total = drop(KEYS[1], KEYS[2], KEYS[4], KEYS[5], oldest[1])
  evicted[#evicted + 1] = oldest[1]
end
return {stored, evicted, total, redis.call('ZCARD', KEYS[1]), replaced}
"""
)

# KEYS: lru, bytes, sizes, expiry, block keys. Deletes the blocks, whatever they hold, and gives their bytes
# back; returns the keys deleted.
_REMOVE = (
    _DROP
    + """
local removed = {}
for i = 5, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    removed[#removed + 1] = KEYS[i]
  end
  drop(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[i])
end
return removed
"""
)


class RedisStore(KVStore):
    medium = "REDIS"
    persistent = True

    def __init__(
        self,
        layout: KVLayout,
        url: str,
        capacity_bytes: int,
        *,
        password: str | None = None,
        timeout_s: float = 2.0,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(layout, capacity_bytes, wall_clock)
        self.url = redacted_url(url)  # what logs show
        self._client = redis.Redis.from_url(  # a password in the URL wins over ``password``
            url,
            password=password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        prefix = f"prefixcache:{layout.namespace.hex()}:"
        self._block_prefix = f"{prefix}kv:"
        self._lru, self._bytes, self._clock_key = f"{prefix}lru", f"{prefix}bytes", f"{prefix}clock"
        self._sizes, self._expiry = f"{prefix}sizes", f"{prefix}expiry"
        self._layout_key = f"{prefix}layout"
        self._load_script = self._client.register_script(_LOAD)
        self._held_script = self._client.register_script(_HELD)
        self._store_script = self._client.register_script(_STORE)
        self._remove_script = self._client.register_script(_REMOVE)
        self._clock = clock
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._backoff_s = retry_initial_s
        self._next_retry = 0.0
        self._down_reported = False
        self.stats.available = False
        self._reconnect()

    @property
    def available(self) -> bool:
        """True while Redis answers; when it is down, the next call after the backoff tries again."""
        if not self.stats.available and self._clock() >= self._next_retry:
            self._reconnect()
        return self.stats.available

    def key_of(self, block_hash: BlockHash) -> str:
        return self._block_prefix + block_hash.hex()

    def close(self) -> None:
        super().close()
        self._next_retry = float("inf")
        self._client.close()

    def _reconnect(self) -> None:
        try:
            self._client.ping()
            self._client.set(self._layout_key, json.dumps(self.layout.describe()))
        except redis.RedisError as exc:
            self._mark_down(exc)
            return
        with self._lock:
            self.stats.available = True
        self._backoff_s = self._retry_initial_s
        if self._down_reported:
            self._down_reported = False
            logger.warning("REDIS tier at %s is reachable again; using it", self.url)

    def _mark_down(self, exc: Exception) -> None:
        with self._lock:
            self.stats.available = False
            self.stats.errors += 1
        self._next_retry = self._clock() + self._backoff_s
        if not self._down_reported:
            self._down_reported = True
            logger.warning(
                "REDIS tier at %s unavailable (%s); serving without it, retrying in %.1f s and backing off",
                self.url,
                exc,
                self._backoff_s,
            )
        self._backoff_s = min(self._backoff_s * 2, self._retry_max_s)

    def _call(self, fn: Callable[[], T]) -> T | None:
        """Run a Redis command; a lost connection marks the tier down, any other Redis error is counted."""
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._mark_down(exc)
        except redis.RedisError as exc:
            self._count_error("command", "REDIS tier at %s: %s; treated as a miss", self.url, exc)
        return None

    def _load_prefix(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        keys = [self._lru, self._clock_key, *(self.key_of(h) for h in hashes)]
        records = self._call(lambda: self._load_script(keys=keys))
        out: list[bytes] = []
        now = self.wall_clock()
        for block_hash, record in zip(hashes, records or (), strict=False):
            kept = None if record is None else record_retention(record)
            if kept is not None and kept.expires_at <= now:  # Redis's clock is behind ours: expired all the same
                self.discard([block_hash])
                break
            payload = NOT_A_RECORD if record is None else decode_record(self.layout, block_hash, record)
            if isinstance(payload, BadRecord):
                self._count_bad(block_hash, payload, self.key_of(block_hash))
                self.discard([block_hash])
                break
            out.append(payload)
        return out

    def _count_held(self, hashes: Sequence[BlockHash]) -> int:
        keys = [self.key_of(h) for h in hashes]
        return int(self._call(lambda: self._held_script(keys=keys)) or 0)

    def _discard(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        keys = [self._lru, self._bytes, self._sizes, self._expiry, *(self.key_of(h) for h in hashes)]
        removed = self._call(lambda: self._remove_script(keys=keys))
        return [self._hash_of(k) for k in removed or ()]

    def _store(
        self, items: Sequence[tuple[BlockHash, bytes]], retention: Mapping[BlockHash, RecordRetention]
    ) -> tuple[list[BlockHash], list[BlockHash]]:
        keys = [self._lru, self._bytes, self._clock_key, self._sizes, self._expiry]
        args: list[bytes | int] = [self.capacity_bytes, int(self.wall_clock() * 1000)]
        for block_hash, payload in items:
            kept = retention.get(block_hash)
            keys.append(self.key_of(block_hash))
            args.append(encode_record(self.layout, block_hash, payload, kept))
            if kept is None:
                args += [0, 0]
            else:
                args += [kept.priority - DEFAULT_PRIORITY, max(1, int(kept.expires_at * 1000))]
        result = self._call(lambda: self._store_script(keys=keys, args=args))
        if result is None:
            return [], []
        stored_keys, evicted_keys, used, num_blocks, replaced_keys = result
        with self._lock:
            self.stats.used_bytes, self.stats.num_blocks = int(used), int(num_blocks)
        for key in replaced_keys:
            self._count_bad(self._hash_of(key), NOT_A_RECORD, key.decode())
        return [self._hash_of(k) for k in stored_keys], [self._hash_of(k) for k in evicted_keys]

    def _hash_of(self, key: bytes) -> BlockHash:
        return BlockHash(bytes.fromhex(key.decode()[len(self._block_prefix) :]))
