"""The offload options as the user writes them (``--kv-offload-cpu 8GiB``, ``--kv-offload-disk PATH[:SIZE]``,
``--kv-offload-redis redis://HOST:PORT[/DB][?capacity=SIZE]``), read and checked once."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from prefixcache.offload.connector import OFFLOAD_MODES, WRITE_BACK
from prefixcache.units import parse_memory

DEFAULT_DISK_BYTES = 10 * 2**30
DEFAULT_REDIS_BYTES = 4 * 2**30
REDIS_SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """Which tiers sit behind the device cache, how large each is, and how the host tier is filled."""

    cpu_bytes: int | None = None
    disk_path: str | None = None
    disk_bytes: int = DEFAULT_DISK_BYTES
    redis_url: str | None = None
    redis_bytes: int = DEFAULT_REDIS_BYTES
    mode: str = WRITE_BACK

    def __post_init__(self) -> None:
        if self.mode not in OFFLOAD_MODES:
            raise ValueError(f"kv_offload_mode must be one of {', '.join(OFFLOAD_MODES)}, got {self.mode!r}")
        for name in ("cpu_bytes", "disk_bytes", "redis_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")

    @property
    def enabled(self) -> bool:
        return self.cpu_bytes is not None or self.disk_path is not None or self.redis_url is not None

    @classmethod
    def parse(
        cls, cpu: str | int | None, disk: str | None, redis_url: str | None, mode: str = WRITE_BACK
    ) -> OffloadConfig:
        """From the engine options; ValueError naming the option for anything unreadable."""
        disk_path, disk_bytes = parse_disk_spec(disk) if disk else (None, DEFAULT_DISK_BYTES)
        url, redis_bytes = parse_redis_spec(redis_url) if redis_url else (None, DEFAULT_REDIS_BYTES)
        try:
            cpu_bytes = None if cpu is None else parse_memory(cpu)
        except ValueError as exc:
            raise ValueError(f"kv_offload_cpu: {exc}") from None
        return cls(cpu_bytes, disk_path, disk_bytes, url, redis_bytes, mode)


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
    """``redis://HOST:PORT[/DB][?capacity=SIZE]``: the URL for redis-py (without ``capacity``) and the capacity."""
    parts = urlsplit(spec)
    if parts.scheme not in REDIS_SCHEMES:
        raise ValueError(f"kv_offload_redis must be a redis:// URL, got {spec!r}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    capacity = DEFAULT_REDIS_BYTES
    for key, value in query:
        if key == "capacity":
            try:
                capacity = parse_memory(value)
            except ValueError as exc:
                raise ValueError(f"kv_offload_redis capacity: {exc}") from None
    rest = urlencode([(k, v) for k, v in query if k != "capacity"])
    return urlunsplit(parts._replace(query=rest)), capacity
