"""``--kv-events-config``: vLLM's ``KVEventsConfig`` fields and defaults, plus how block hashes go on the wire.

Pure standard library, so the command-line parser and ``EngineConfig`` import it without zmq or msgspec.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

PUBLISHERS = ("null", "zmq")
# "uint64": vLLM's default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), the low 64 bits of the digest read
# big-endian; "bytes": the whole digest, as vLLM sends with that variable set to 0.
BLOCK_HASH_ENCODINGS = ("uint64", "bytes")
# How the PUB socket opens ``endpoint``: "auto" is vLLM's rule (bind an address with ``*`` or ``::``, ipc://
# and inproc://, connect to any other), "bind" binds it as given (one address, e.g. tcp://10.0.0.2:5557),
# "connect" dials out to a subscriber that binds it.
ENDPOINT_MODES = ("auto", "bind", "connect")
_SCHEMES = ("tcp", "ipc", "inproc")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"kv_events_config.{name} must be an integer >= {minimum}, got {value!r}")


def binds(endpoint: str, mode: str = "auto") -> bool:
    """Whether a PUB socket binds ``endpoint`` in ``mode``; "auto" is vLLM's rule: bind a wildcard (``*``,
    ``::``), ipc:// and inproc://, connect to the rest."""
    if mode == "auto":
        return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    return mode == "bind"


def _check_endpoint(name: str, value: Any) -> None:
    scheme, separator, address = value.partition("://") if isinstance(value, str) else ("", "", "")
    if scheme not in _SCHEMES or not separator or not address:
        raise ValueError(f"kv_events_config.{name} must be a ZeroMQ address such as 'tcp://*:5557', got {value!r}")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Where and how the engine publishes KV cache events (vLLM's names and defaults).

    ``publisher`` defaults to ``"zmq"`` when events are enabled and ``"null"`` otherwise. With
    ``endpoint_mode`` "auto", an ``endpoint`` with ``*``, ``::``, ``ipc://`` or ``inproc://`` is bound, any
    other is connected to (vLLM's rule); "bind" binds it whatever it is, so one address (loopback or a
    private one) can be published on without the wildcard; "connect" always connects. ``replay_endpoint``
    is always bound. ``buffer_steps`` batches are kept for replay; ``max_queue_size`` batches may wait for
    the publisher thread before new ones are dropped. ``publish_token_ids`` false leaves the prompts' token
    ids out of ``BlockStored`` (a router needs only the hashes); the cache salt is never published.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    block_hash_encoding: str = "uint64"
    endpoint_mode: str = "auto"
    publish_token_ids: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(
                f"kv_events_config.enable_kv_cache_events must be true or false, got {self.enable_kv_cache_events!r}"
            )
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ValueError(
                f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}, got {self.publisher!r}"
            )
        _check_endpoint("endpoint", self.endpoint)
        if self.endpoint_mode not in ENDPOINT_MODES:
            raise ValueError(
                f"kv_events_config.endpoint_mode must be one of {', '.join(ENDPOINT_MODES)}, got {self.endpoint_mode!r}"
            )
        if self.endpoint_mode == "connect" and "*" in self.endpoint:
            raise ValueError(
                f"kv_events_config.endpoint {self.endpoint!r} has a wildcard, which can be bound, not connected to"
            )
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint)
        _check_int("buffer_steps", self.buffer_steps, 1)
        _check_int("hwm", self.hwm, 0)
        _check_int("max_queue_size", self.max_queue_size, 1)
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config.topic must be a string, got {self.topic!r}")
        if not isinstance(self.publish_token_ids, bool):
            raise ValueError(
                f"kv_events_config.publish_token_ids must be true or false, got {self.publish_token_ids!r}"
            )
        if self.block_hash_encoding not in BLOCK_HASH_ENCODINGS:
            raise ValueError(
                f"kv_events_config.block_hash_encoding must be one of {', '.join(BLOCK_HASH_ENCODINGS)}, "
                f"got {self.block_hash_encoding!r}"
            )

    @property
    def binds_endpoint(self) -> bool:
        """Whether the PUB socket binds ``endpoint`` (subscribers connect to it) rather than connecting to it."""
        return binds(self.endpoint, self.endpoint_mode)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVEventsConfig:
        if not isinstance(values, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"kv_events_config: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse ``--kv-events-config '{"enable_kv_cache_events": true, ...}'``."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv_events_config is not valid JSON ({exc}): {text!r}") from None
        return cls.from_dict(values)

    @classmethod
    def coerce(cls, value: KVEventsConfig | dict[str, Any] | str | None) -> KVEventsConfig | None:
        """A config from itself, a dict of fields or a JSON object string (what ``EngineConfig`` accepts)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls.from_json(value)
        return cls.from_dict(value)
