"""``prefixcache explain``: why a request log's prompts miss the prefix cache, and what would fix it."""
