"""The HTTP pieces the server and the router both speak: the OpenAI and Anthropic request and error shapes,
the API's retention directives, API keys on the wire, the middleware (request ids and logs, body limit, keys)
and the flags both commands take.

Below both: it imports the engine's public types and ``core``, never ``prefixcache.server`` or
``prefixcache.router``.
"""
