"""API keys on the wire: what an ``Authorization: Bearer KEY`` header may carry and how it is read.

The server checks keys with them, and the router reads a client's key with the same rule to predict the
tenant salt a keyed server will use (``core/tenant_salt.py``).
"""

from __future__ import annotations

BEARER = "Bearer "


def valid_api_key(key: str) -> bool:
    """What ``Authorization: Bearer KEY`` can carry unambiguously: non-empty printable ASCII without spaces."""
    return bool(key) and key.isascii() and key.isprintable() and " " not in key


def bearer_token(authorization: str | None) -> str | None:
    """The key of an ``Authorization`` header as the server reads it (``Bearer KEY`` exactly), else None."""
    if authorization is None or not authorization.startswith(BEARER):
        return None
    key = authorization[len(BEARER) :]
    return key if valid_api_key(key) else None
