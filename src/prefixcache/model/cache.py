"""What the model layer keeps between runs under ``$PREFIXCACHE_CACHE_DIR`` (default ``~/.cache/prefixcache``).

``digests/``: the SHA-256 of a file's bytes, one small JSON entry per resolved path, valid while the file keeps
the identity recorded with it (path, size, mtime_ns, ctime_ns, inode, device). Hashing reads the whole file
once; a restart only stats it. ctime cannot be set back from user space, so a file rewritten in place with
its old size and modification time restored is hashed again. Entries of files that no longer exist are
dropped whenever a new entry is written. The digests identify weights exactly (the offload tiers' namespace
is derived from them), so the folder is created owner-only.

``models/<name>-<first 16 hex of the GGUF's SHA-256>/``: a GGUF file converted once into an HF checkpoint
folder. The folder is keyed by the file's content, not its path, so two installations of one package (two
virtualenvs, each with its copy of the file) share one folder, and a changed file gets a new folder instead
of replacing one that another process may be reading. A folder is built in a temporary sibling and renamed
into place whole. Every process that uses a folder holds a shared ``flock`` on its lease file
(``.prefixcache-lease``) until it exits; after a conversion, older folders whose recorded source no longer
holds their content (the file changed or is gone) are removed, each only if an exclusive lock on its lease
shows that no process uses it, and by renaming it away first, so a process starting to use it at that
moment sees it gone and converts again instead of reading a half-deleted folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

DIGEST_ALGO = "sha256"
SOURCE_FILE = "prefixcache_source.json"  # in a converted folder: which GGUF content it holds
LEASE_FILE = ".prefixcache-lease"
_FOLDER_DIGEST_HEX = 16
_LEASE_ATTEMPTS = 3
# The folders this process uses, each with its lease file open under a shared lock, until the process exits.
_leases: dict[Path, IO[bytes]] = {}


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


def converted_checkpoint(gguf: Path, name: str, convert: Callable[[Path, Path], None]) -> Path:
    """The HF checkpoint folder converted from ``gguf`` (``convert(gguf, folder)`` writes one), converting it
    first unless a folder for its content exists; this process holds the folder's lease from now on."""
    gguf = gguf.resolve()
    digest = file_digest(gguf)
    target = cache_dir() / "models" / f"{name}-{digest[:_FOLDER_DIGEST_HEX]}"
    for _ in range(_LEASE_ATTEMPTS):
        if _take_lease(target):
            if _is_converted(target, digest):
                logger.info("using converted checkpoint %s (from %s)", target, gguf)
                return target
            _release_lease(target)
        _convert(gguf, digest, target, convert)
    raise RuntimeError(f"{target} was removed each time it was converted; is another process cleaning the cache?")


def _convert(gguf: Path, digest: str, target: Path, convert: Callable[[Path, Path], None]) -> None:
    """Build the folder for ``gguf`` in a temporary sibling and rename it into place; a process that got there
    first wins and its folder is used. Then remove older folders nobody uses whose source changed."""
    models = target.parent
    models.mkdir(parents=True, exist_ok=True)
    if target.exists() and not _is_converted(target, digest):
        _remove_if_unused(target)  # not a complete conversion (no process leases one)
    logger.info("converting %s to an HF checkpoint in %s (one-time, ~20 s)", gguf, target)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=models))
    try:
        convert(gguf, tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf), DIGEST_ALGO: digest}, indent=2) + "\n")
        (tmp / LEASE_FILE).touch()
        # mkdtemp and some writers create owner-only entries; make the folder readable like any checkpoint.
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        try:
            os.replace(tmp, target)
        except OSError:
            if not _is_converted(target, digest):
                raise
            logger.info("another process converted %s first; using its folder", gguf)
            return
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s to %s in %.1fs", gguf, target, time.perf_counter() - start)
    _remove_stale(models, keep=target)


def converted_from(folder: Path) -> Path | None:
    """The GGUF file a converted folder holds, when it still has that content (the server hands its core the
    folder, and ``quantization="gguf"`` reads the quantized weights from the file); None otherwise."""
    source = _read_source(folder)
    if source is None:
        return None
    gguf = Path(source["gguf"])
    return gguf if gguf.is_file() and file_digest(gguf) == source[DIGEST_ALGO] else None


def _is_converted(folder: Path, digest: str) -> bool:
    source = _read_source(folder)
    return source is not None and source[DIGEST_ALGO] == digest and (folder / "config.json").is_file()


def _read_source(folder: Path) -> dict[str, Any] | None:
    """The source a folder was converted from, ``{"gguf": path, "sha256": digest}``; None if it has none."""
    try:
        source = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(source, dict) or not all(isinstance(source.get(k), str) for k in ("gguf", DIGEST_ALGO)):
        return None  # a folder of an older version (keyed by path): left alone
    return source


def _remove_stale(models: Path, keep: Path) -> None:
    """Remove the converted folders whose recorded source no longer holds their content and that nobody uses."""
    for folder in models.iterdir():
        skipped = folder == keep or folder.name.startswith(".")  # ours, or a conversion in flight
        source = None if skipped or not folder.is_dir() else _read_source(folder)
        if source is None:
            continue
        gguf = Path(source["gguf"])
        try:
            current = file_digest(gguf) if gguf.is_file() else None
        except OSError:
            current = None
        if current != source[DIGEST_ALGO] and _remove_if_unused(folder):
            logger.info("removed %s: its source %s changed or is gone, and no process uses it", folder, gguf)


def _take_lease(folder: Path) -> bool:
    """Hold a shared lock on ``folder``'s lease until the process exits; False if there is no folder, or it was
    renamed away (by a cleaner) while the lock was awaited."""
    if folder in _leases:
        return True
    lease_path = folder / LEASE_FILE
    try:
        lease = open(lease_path, "rb")  # noqa: SIM115 - held open until the process exits
    except OSError:
        return False
    fcntl.flock(lease, fcntl.LOCK_SH)  # waits only while a cleaner renames the folder away
    try:
        opened, now = os.fstat(lease.fileno()), os.stat(lease_path)
        same = (opened.st_ino, opened.st_dev) == (now.st_ino, now.st_dev)
    except OSError:
        same = False
    if not same:
        lease.close()
        return False
    _leases[folder] = lease
    return True


def _release_lease(folder: Path) -> None:
    lease = _leases.pop(folder, None)
    if lease is not None:
        lease.close()


def _remove_if_unused(folder: Path) -> bool:
    """Rename ``folder`` away and delete it, unless a process holds its lease; True if it was removed."""
    try:
        lease = open(folder / LEASE_FILE, "rb")  # noqa: SIM115 - closed below, after the rename
    except FileNotFoundError:
        lease = None  # not a complete conversion: nobody can hold its lease
    try:
        if lease is not None:
            try:
                fcntl.flock(lease, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info("kept %s: a process uses it", folder)
                return False
        graveyard = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
        os.replace(folder, graveyard / folder.name)
    finally:
        if lease is not None:
            lease.close()
    shutil.rmtree(graveyard, ignore_errors=True)
    return True
