"""The OpenAI-compatible HTTP server: ``prefixcache serve``.

One engine loop batches every in-flight request; responses report how many prompt tokens came from the
prefix cache, and ``cache_salt`` keeps tenants from sharing cached blocks.
"""
