"""What the model layer keeps between runs under ``$PREFIXCACHE_CACHE_DIR`` (default ``~/.cache/prefixcache``).

``digests/``: the SHA-256 of a file's bytes, one small JSON entry per resolved path, valid while the file keeps
the identity recorded with it (path, size, mtime_ns, ctime_ns, inode, device). Hashing reads the whole file
once; a restart only stats it. ctime cannot be set back from user space, so a file rewritten in place with
its old size and modification time restored is hashed again. Entries of files that no longer exist are
dropped whenever a new entry is written. The digests identify weights exactly (the offload tiers' namespace
is derived from them), so the folder is created owner-only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

DIGEST_ALGO = "sha256"


def cache_dir() -> Path:
    """``$PREFIXCACHE_CACHE_DIR``, else ``~/.cache/prefixcache``."""
    base = os.environ.get("PREFIXCACHE_CACHE_DIR")
    return Path(base).expanduser() if base else Path.home() / ".cache" / "prefixcache"


def file_digest(path: Path) -> str:
    """SHA-256 of the bytes of ``path`` (hex): read once per file identity, then taken from ``digests/``.

    A cache that cannot be read or written only costs the hashing again; it never fails the caller.
    """
    path = path.resolve()
    identity = _identity(path, path.stat())
    entry = cache_dir() / "digests" / f"{hashlib.sha256(str(path).encode()).hexdigest()}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        cached = json.loads(entry.read_text())
        if cached["identity"] == identity and isinstance(cached[DIGEST_ALGO], str):
            return cached[DIGEST_ALGO]
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, DIGEST_ALGO).hexdigest()
        unchanged = _identity(path, os.fstat(f.fileno())) == identity
    if unchanged:  # a file replaced or written while it was read is hashed again next time
        with contextlib.suppress(OSError):
            _write_entry(entry, {"identity": identity, DIGEST_ALGO: digest})
    return digest


def files_digest(files: Sequence[Path]) -> str:
    """One SHA-256 for a set of files (a checkpoint's weight shards): each file's name and content digest."""
    combined = hashlib.sha256()
    for file in files:
        combined.update(f"{file.name}\0{file_digest(file)}\n".encode())
    return combined.hexdigest()


def _identity(path: Path, stat: os.stat_result) -> dict[str, int | str]:
    return {
        "path": str(path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "ctime_ns": stat.st_ctime_ns,
        "inode": stat.st_ino,
        "device": stat.st_dev,
    }


def _write_entry(entry: Path, content: dict) -> None:
    """Write ``entry`` atomically (temporary file, rename) and drop the entries of files that are gone."""
    folder = entry.parent
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(content, f)
        os.replace(tmp, entry)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    for other in folder.glob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            if not Path(json.loads(other.read_text())["identity"]["path"]).exists():
                other.unlink()
