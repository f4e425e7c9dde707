"""The local disk tier: one checksummed file a block, kept across restarts, LRU by modification time within a priority.

Layout under the root directory: ``<namespace>/layout.json`` says in words what the blocks are valid for,
``<namespace>/<2 hex>/<block hash hex>.kv`` are the records, ``<namespace>/tmp/`` holds writes in flight (a
record is written there and renamed into place, so a reader never sees half a file; a crash leaves only
a temporary file, removed at the next start). Other namespaces in the same root (other models, dtypes or
block sizes) are left alone and do not count against this store's capacity.

A namespace directory belongs to one store at a time: ``<namespace>/lock`` is held with ``flock`` while the
store is open (the kernel drops it when the process dies), and a second store, in this process or another,
is refused with an error naming the holder's pid. Two engines on one directory would each keep the
capacity for its own index only, and delete each other's writes in flight. Records hold prompts in
recoverable form, so the tier's folders are created 0700 and its files 0600 whatever the umask, and a
namespace directory found wider (made by an older version) is narrowed to 0700 when opened.

At start the namespace directory is scanned: its records, oldest modification first, are the LRU order; a
hit touches the file, so the order survives a restart. A record kept under a retention directive names its
priority and expiry in its header (read at start, so the priority order survives too): it is evicted in the
device pool's order (expired first, then the lowest priority), and once expired it is a miss and is deleted.
A record is verified when it is read; one that is truncated, corrupt or foreign is deleted and counts as a
miss. Running out of space, or a directory that cannot be written, turns the tier off with one log line; the
engine serves on without it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from prefixcache.core.hashing import BlockHash
from prefixcache.offload.record import (
    BadRecord,
    KVLayout,
    RecordRetention,
    decode_record,
    encode_record,
    record_retention,
)
from prefixcache.offload.store import KVStore, RetentionOrder, held_run

logger = logging.getLogger(__name__)

SUFFIX = ".kv"
LOCK_FILE = "lock"
# Enough of a record to hold its header up to the retention field (a block hash of up to 64 bytes).
RECORD_HEAD_BYTES = 128
DIR_MODE = 0o700
FILE_MODE = 0o600
# Errors that mean the directory cannot take writes at all: retrying block after block would only fail again.
DISABLING_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


class DiskStore(KVStore):
    medium = "DISK"
    persistent = True

    def __init__(
        self,
        layout: KVLayout,
        root: str | os.PathLike,
        capacity_bytes: int,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(layout, capacity_bytes, wall_clock)
        self.root = Path(root)
        self.directory = self.root / layout.namespace.hex()
        self._tmp = self.directory / "tmp"
        self._index: dict[BlockHash, int] = {}  # hash -> file size
        self._order = RetentionOrder(self.wall_clock)
        self._last_use_ns = 0
        self._lock_file: int | None = None
        try:
            self._open()
        except OSError as exc:
            self._disable(exc)

    def close(self) -> None:
        """Stop using the directory and release it for the next store."""
        super().close()
        if self._lock_file is not None:
            os.close(self._lock_file)
            self._lock_file = None

    def _open(self) -> None:
        self.root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        for folder in (self.directory, self._tmp):
            _owner_only_dir(folder)
        self._take_directory()
        for leftover in self._tmp.iterdir():
            leftover.unlink(missing_ok=True)
        description = self.directory / "layout.json"
        if not description.exists():
            self._write_atomically(description, json.dumps(self.layout.describe(), indent=2).encode())
        found: list[tuple[float, BlockHash, int]] = []
        for sub in self.directory.iterdir():
            if not sub.is_dir() or sub == self._tmp:
                continue
            for entry in os.scandir(sub):
                block_hash = _hash_from_name(entry.name)
                if block_hash is not None and entry.is_file():
                    stat = entry.stat()
                    found.append((stat.st_mtime_ns, block_hash, stat.st_size, _read_retention(entry.path)))
        found.sort(key=lambda item: item[0])
        if found:
            self._last_use_ns = found[-1][0]
        for _, block_hash, size, retention in found:
            self._index_add(block_hash, size, retention)
        evicted = self._evict_beyond_capacity()
        logger.info(
            "DISK tier at %s: %d blocks (%.1f MiB) kept from before, capacity %.1f MiB",
            self.directory,
            len(self._index),
            self.stats.used_bytes / 2**20,
            self.capacity_bytes / 2**20,
        )
        if evicted:
            logger.info("DISK tier: evicted %d blocks beyond the capacity", len(evicted))

    def _take_directory(self) -> None:
        """Hold the namespace directory's lock; ValueError when another store holds it (a misconfiguration)."""
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(
                f"kv_offload_disk: {self.directory} is in use by another engine (pid {holder}); give each engine "
                "its own directory (one directory's capacity is kept by the one engine that holds it)"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_file = fd

    def path_of(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.directory / name[:2] / (name + SUFFIX)

    def _load_prefix(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        out: list[bytes] = []
        for block_hash in hashes:
            with self._lock:
                if block_hash not in self._index:
                    break
                expired = self._order.expired(block_hash)
            if expired:
                self.discard([block_hash])
                break
            path = self.path_of(block_hash)
            try:
                record = path.read_bytes()
            except FileNotFoundError:
                self._index_pop(block_hash)
                break
            except OSError as exc:
                self._count_error("read", "DISK tier: cannot read %s (%s); treated as a miss", path, exc)
                break
            payload = decode_record(self.layout, block_hash, record)
            if isinstance(payload, BadRecord):
                self._count_bad(block_hash, payload, str(path))
                self.discard([block_hash])
                break
            with self._lock:
                if block_hash in self._index:
                    self._order.touch(block_hash)
            self._mark_used(path)
            out.append(payload)
        return out

    def _count_held(self, hashes: Sequence[BlockHash]) -> int:
        with self._lock:
            held = held_run(hashes, self._index)
            return next((i for i, h in enumerate(hashes[:held]) if self._order.expired(h)), held)

    def _discard(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        removed = []
        for block_hash in hashes:
            path = self.path_of(block_hash)
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                self._count_error("delete", "DISK tier: cannot delete %s (%s)", path, exc)
            if self._index_pop(block_hash):
                removed.append(block_hash)
        return removed

    def _store(
        self, items: Sequence[tuple[BlockHash, bytes]], retention: Mapping[BlockHash, RecordRetention]
    ) -> tuple[list[BlockHash], list[BlockHash]]:
        stored: list[BlockHash] = []
        evicted: list[BlockHash] = []
        for block_hash, payload in items:
            with self._lock:
                held, expired = block_hash in self._index, self._order.expired(block_hash)
            if held and not expired:
                continue
            if expired:  # its time ran out: rewritten below as new
                self._index_pop(block_hash)
            kept = retention.get(block_hash)
            record = encode_record(self.layout, block_hash, payload, kept)
            if len(record) > self.capacity_bytes:
                continue
            path = self.path_of(block_hash)
            try:
                path.parent.mkdir(mode=DIR_MODE, exist_ok=True)
                self._write_atomically(path, record)
                self._mark_used(path)
            except OSError as exc:
                if exc.errno in DISABLING_ERRNOS:
                    self._disable(exc)
                    break
                self._count_error("write", "DISK tier: cannot write %s (%s); block not stored", path, exc)
                continue
            self._index_add(block_hash, len(record), kept)
            stored.append(block_hash)
            evicted += self._evict_beyond_capacity()
        return stored, evicted

    def _write_atomically(self, path: Path, data: bytes) -> None:
        """Write to a temporary file in the same filesystem, then rename: readers see all of it or nothing."""
        tmp = self._tmp / f"{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb", opener=_owner_only_file) as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _mark_used(self, path: Path) -> None:
        """Set the file's mtime to a time later than every earlier use: the LRU order a restart reads back.

        File times can be coarser than the gap between two writes; strictly increasing times keep the order.
        """
        with self._lock:
            self._last_use_ns = max(time.time_ns(), self._last_use_ns + 1)
            used_ns = self._last_use_ns
        with contextlib.suppress(OSError):  # evicted or unwritable since: the LRU order only loses one touch
            os.utime(path, ns=(used_ns, used_ns))

    def _evict_beyond_capacity(self) -> list[BlockHash]:
        """Delete records in eviction order (expired, lowest priority, least recently used) until the rest fit."""
        evicted: list[BlockHash] = []
        while True:
            with self._lock:
                if self.stats.used_bytes <= self.capacity_bytes or not self._index:
                    break
                block_hash = self._order.pop()
                size = self._index.pop(block_hash)
                self.stats.used_bytes -= size
                self.stats.num_blocks -= 1
            path = self.path_of(block_hash)
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                self._count_error("evict", "DISK tier: cannot delete %s (%s)", path, exc)
            evicted.append(block_hash)
        return evicted

    def _index_add(self, block_hash: BlockHash, size: int, retention: RecordRetention | None = None) -> None:
        with self._lock:
            self._index[block_hash] = size
            self._order.add(block_hash, retention)
            self.stats.used_bytes += size
            self.stats.num_blocks += 1

    def _index_pop(self, block_hash: BlockHash) -> bool:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is None:
                return False
            self._order.remove(block_hash)
            self.stats.used_bytes -= size
            self.stats.num_blocks -= 1
            return True

    def _disable(self, exc: OSError) -> None:
        with self._lock:
            was_available = self.stats.available
            self.stats.available = False
            self.stats.errors += 1
        if was_available:
            logger.error(
                "DISK tier at %s turned off: %s. Serving goes on without it; fix the directory and restart to use it",
                self.directory,
                exc,
            )


def _owner_only_dir(path: Path) -> None:
    """Create ``path`` 0700, or narrow it to 0700 if it exists wider (a mode the umask cannot widen)."""
    path.mkdir(mode=DIR_MODE, exist_ok=True)
    if path.stat().st_mode & 0o777 != DIR_MODE:
        path.chmod(DIR_MODE)


def _owner_only_file(path: str, flags: int) -> int:
    """``open``'s opener: a new file is 0600 whatever the umask."""
    return os.open(path, flags, FILE_MODE)


def _read_retention(path: str) -> RecordRetention | None:
    """The retention in a record file's header (None without one, or when it cannot be read: a plain LRU entry)."""
    try:
        with open(path, "rb") as f:
            return record_retention(f.read(RECORD_HEAD_BYTES))
    except OSError:
        return None


def _hash_from_name(name: str) -> BlockHash | None:
    if not name.endswith(SUFFIX):
        return None
    try:
        return BlockHash(bytes.fromhex(name[: -len(SUFFIX)]))
    except ValueError:
        return None
