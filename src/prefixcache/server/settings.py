"""The server's own settings (what is not the engine's): one frozen, validated dataclass, built once from the
command line by ``server/cli.py`` and read by the app and its routes from ``app.state.settings``."""

from __future__ import annotations

from dataclasses import dataclass

from prefixcache.http.auth import valid_api_key
from prefixcache.http.flags import DEFAULT_MAX_REQUEST_BYTES

LOG_STATS_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """``served_model_names[0]`` is the name reported by /v1/models; requests may use any of them.

    Each of ``api_keys`` is a tenant with its own prefix cache unless ``share_cache_across_keys``.
    ``metrics_api_key``, when set, is the only key /metrics takes (and it takes no other path), so a tenant's
    key cannot watch the server-wide counters move; unset, /metrics takes any of ``api_keys``.
    """

    served_model_names: tuple[str, ...]
    api_keys: tuple[str, ...] = ()
    metrics_api_key: str | None = None
    share_cache_across_keys: bool = False
    enable_reset_prefix_cache: bool = False
    log_stats_interval: float | None = LOG_STATS_INTERVAL_S
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    log_requests: bool = True

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("at least one served model name is needed")
        if not all(map(valid_api_key, self.api_keys)):
            raise ValueError("API keys must be non-empty printable ASCII without spaces")
        if self.metrics_api_key is not None:
            if not valid_api_key(self.metrics_api_key):
                raise ValueError("the metrics API key must be non-empty printable ASCII without spaces")
            if self.metrics_api_key in self.api_keys:
                raise ValueError("the metrics API key must differ from every tenant's API key")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {self.max_request_bytes}")
