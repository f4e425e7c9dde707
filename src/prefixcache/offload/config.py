"""The offload options as the user writes them (``--kv-offload-cpu 8GiB``, ``--kv-offload-disk PATH[:SIZE]``,
``--kv-offload-redis redis://HOST:PORT[/DB][?capacity=SIZE]``, ``--kv-offload-secret-file PATH``), read and
checked once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from prefixcache.core.retention import MAX_PRIORITY, MIN_PRIORITY
from prefixcache.offload.connector import OFFLOAD_MODES, WRITE_BACK
from prefixcache.offload.record import RecordKey
from prefixcache.units import parse_memory

DEFAULT_DISK_BYTES = 10 * 2**30
DEFAULT_REDIS_BYTES = 4 * 2**30
REDIS_SCHEMES = ("redis", "rediss", "unix")
SECRET_ENV = "PREFIXCACHE_KV_OFFLOAD_SECRET"
REDIS_PASSWORD_ENV = "PREFIXCACHE_KV_OFFLOAD_REDIS_PASSWORD"
# Query options of a Redis URL that redis-py takes; any other is refused (redis-py would pass it on to the
# connection, which fails at the first command). TLS options need rediss://; those naming files must exist.
REDIS_OPTIONS = frozenset(
    {"db", "client_name", "socket_timeout", "socket_connect_timeout", "socket_keepalive", "health_check_interval"}
)
REDIS_TLS_OPTIONS = frozenset(
    {"ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_password", "ssl_cert_reqs"}
    | {"ssl_check_hostname", "ssl_ciphers"}
)
_REDIS_TLS_FILES = {"ssl_ca_certs": Path.is_file, "ssl_certfile": Path.is_file, "ssl_keyfile": Path.is_file}
_REDIS_TLS_FILES["ssl_ca_path"] = Path.is_dir
_REDIS_CERT_REQS = ("none", "optional", "required")


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """Which tiers sit behind the device cache, how large each is, and how the host tier is filled.

    ``record_key`` authenticates the records of the disk and Redis tiers (None: checksummed only);
    ``redis_password`` is the Redis password when the URL carries none (from the environment). ``min_priority``:
    blocks (and checkpoints) whose retention priority is below it are dropped where they would go to a tier
    (TensorRT-LLM's secondary offload minimum priority); 0, the default, offloads every block.
    """

    cpu_bytes: int | None = None
    disk_path: str | None = None
    disk_bytes: int = DEFAULT_DISK_BYTES
    redis_url: str | None = None
    redis_bytes: int = DEFAULT_REDIS_BYTES
    mode: str = WRITE_BACK
    record_key: RecordKey | None = field(default=None, repr=False)
    redis_password: str | None = field(default=None, repr=False)
    min_priority: int = MIN_PRIORITY

    def __post_init__(self) -> None:
        if self.mode not in OFFLOAD_MODES:
            raise ValueError(f"kv_offload_mode must be one of {', '.join(OFFLOAD_MODES)}, got {self.mode!r}")
        priority = self.min_priority
        if isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            raise ValueError(
                f"kv_offload_min_priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {priority!r}"
            )
        for name in ("cpu_bytes", "disk_bytes", "redis_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")

    @property
    def enabled(self) -> bool:
        return self.cpu_bytes is not None or self.disk_path is not None or self.redis_url is not None

    @classmethod
    def parse(
        cls,
        cpu: str | int | None,
        disk: str | None,
        redis_url: str | None,
        mode: str = WRITE_BACK,
        secret_file: str | None = None,
        min_priority: int = MIN_PRIORITY,
    ) -> OffloadConfig:
        """From the engine options; ValueError naming the option for anything unreadable."""
        disk_path, disk_bytes = parse_disk_spec(disk) if disk else (None, DEFAULT_DISK_BYTES)
        url, redis_bytes = parse_redis_spec(redis_url) if redis_url else (None, DEFAULT_REDIS_BYTES)
        try:
            cpu_bytes = None if cpu is None else parse_memory(cpu)
        except ValueError as exc:
            raise ValueError(f"kv_offload_cpu: {exc}") from None
        record_key = read_record_key(secret_file) if disk_path or url else None  # only shared tiers use it
        password = os.environ.get(REDIS_PASSWORD_ENV) if url and not urlsplit(url).password else None
        return cls(cpu_bytes, disk_path, disk_bytes, url, redis_bytes, mode, record_key, password, min_priority)


def read_record_key(secret_file: str | None) -> RecordKey | None:
    """The deployment secret from ``secret_file`` (surrounding whitespace stripped), else from
    ``$PREFIXCACHE_KV_OFFLOAD_SECRET``; None when neither is given."""
    if secret_file is not None:
        try:
            secret = Path(secret_file).expanduser().read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"kv_offload_secret_file: cannot read {secret_file}: {exc.strerror or exc}") from None
        source = f"kv_offload_secret_file {secret_file}"
    elif SECRET_ENV in os.environ:
        secret = os.environ[SECRET_ENV].strip().encode()
        source = f"${SECRET_ENV}"
    else:
        return None
    try:
        return RecordKey(secret)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def parse_disk_spec(spec: str) -> tuple[str, int]:
    """``PATH[:SIZE]``: a trailing ``:SIZE`` that reads as a size is the capacity, else it is part of the path."""
    path, sep, size = spec.rpartition(":")
    if sep and path:
        try:
            return path, parse_memory(size)
        except ValueError:
            pass
    if not spec.strip():
        raise ValueError("kv_offload_disk needs a directory, e.g. /var/cache/prefixcache:50GiB")
    return spec, DEFAULT_DISK_BYTES


def parse_redis_spec(spec: str) -> tuple[str, int]:
    """``redis[s]://[[USER]:PASSWORD@]HOST:PORT[/DB][?capacity=SIZE&OPTION=VALUE...]``: the URL for redis-py
    (without ``capacity``) and the capacity. ValueError for an option redis-py would not take."""
    parts = urlsplit(spec)
    if parts.scheme not in REDIS_SCHEMES:
        raise ValueError(f"kv_offload_redis must be a redis:// URL, got {redacted_url(spec)!r}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    capacity = DEFAULT_REDIS_BYTES
    for key, value in query:
        if key == "capacity":
            try:
                capacity = parse_memory(value)
            except ValueError as exc:
                raise ValueError(f"kv_offload_redis capacity: {exc}") from None
        else:
            _check_redis_option(parts.scheme, key, value)
    rest = urlencode([(k, v) for k, v in query if k != "capacity"])
    return urlunsplit(parts._replace(query=rest)), capacity


def _check_redis_option(scheme: str, key: str, value: str) -> None:
    if key in REDIS_TLS_OPTIONS:
        if scheme != "rediss":
            raise ValueError(f"kv_offload_redis: {key} is a TLS option, it needs a rediss:// URL")
        if key in _REDIS_TLS_FILES and not _REDIS_TLS_FILES[key](Path(value).expanduser()):
            raise ValueError(f"kv_offload_redis {key}: {value} not found")
        if key == "ssl_cert_reqs" and value not in _REDIS_CERT_REQS:
            raise ValueError(f"kv_offload_redis ssl_cert_reqs must be one of {', '.join(_REDIS_CERT_REQS)}")
    elif key not in REDIS_OPTIONS:
        known = ", ".join(sorted({"capacity"} | REDIS_OPTIONS | REDIS_TLS_OPTIONS))
        raise ValueError(f"kv_offload_redis: unknown option {key!r}; known: {known}")


def redacted_url(url: str) -> str:
    """``url`` with its passwords (the user part's, ``ssl_password``) shown as ``***``, for logs."""
    parts = urlsplit(url)
    if parts.password is not None:
        host = parts.netloc.rpartition("@")[2]
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{host}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any(key == "ssl_password" for key, _ in query):
        parts = parts._replace(query=urlencode([(k, "***" if k == "ssl_password" else v) for k, v in query]))
    return urlunsplit(parts)
