"""API keys on the wire: what an ``Authorization: Bearer KEY`` header may carry and how it is read.

The server checks keys with them, and the router reads a client's key with the same rule to predict the
tenant salt a keyed server will use (``core/tenant_salt.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

BEARER = "Bearer "


def valid_api_key(key: str) -> bool:
    """What ``Authorization: Bearer KEY`` can carry unambiguously: non-empty printable ASCII without spaces."""
    return bool(key) and key.isascii() and key.isprintable() and " " not in key


def authorization(headers: Mapping[str, str]) -> str:
    """The ``Authorization`` header, or Anthropic's ``x-api-key`` as the bearer token it stands for (its SDK
    sends the key there); ``headers`` by lower-case name, as ASGI gives them."""
    if "authorization" in headers or "x-api-key" not in headers:
        return headers.get("authorization", "")
    return f"{BEARER}{headers['x-api-key']}"


def bearer_token(authorization: str | None) -> str | None:
    """The key of an ``Authorization`` header as the server reads it (``Bearer KEY`` exactly), else None."""
    if authorization is None or not authorization.startswith(BEARER):
        return None
    key = authorization[len(BEARER) :]
    return key if valid_api_key(key) else None
