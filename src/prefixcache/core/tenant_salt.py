"""API keys as tenants: how a request's key and its own ``cache_salt`` become the engine's cache salt.

Pure functions beside the hashing they feed (the salt is an extra key of every block hash): the server salts
requests with them, and the router uses the same ones to predict the block hashes a keyed server will publish.
"""

from __future__ import annotations

import hashlib

# ``tenant_salt`` in /v1/cache/config when every API key is a tenant; null when requests are salted by
# their ``cache_salt`` alone (no keys, or ``--share-cache-across-keys``).
SALT_BY_API_KEY = "api_key"


def tenant_salt(api_key: str) -> str:
    """A key's cache salt: a hash, never the key, since salts reach block hashes, events and logs."""
    return "tenant-" + hashlib.sha256(b"prefixcache-tenant\0" + api_key.encode()).hexdigest()[:32]


def engine_salt(tenant: str | None, salt: str | None) -> str | None:
    """The engine's salt: the tenant's (from its API key) and the request's own, so neither can cross the
    other; a client cannot name another tenant's salt, since its own is always in front."""
    if tenant is None:
        return salt
    return tenant if salt is None else f"{tenant}:{salt}"
