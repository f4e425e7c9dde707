"""A prefix-cache-aware router: an OpenAI front that sends each request to the engine holding its longest prefix."""
