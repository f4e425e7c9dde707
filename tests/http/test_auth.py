"""Reading an API key from an ``Authorization`` header."""

from prefixcache.http.auth import bearer_token


def test_a_bearer_token_is_read_as_the_server_compares_it():
    assert bearer_token("Bearer key-1") == "key-1"
    for header in (None, "", "Bearer ", "bearer key-1", "Basic a2V5", "Bearer two words", "Bearer  key-1"):
        assert bearer_token(header) is None
