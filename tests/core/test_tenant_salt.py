"""An API key's cache salt: a hash of the key, put in front of the request's own salt."""

from prefixcache.core.tenant_salt import engine_salt, tenant_salt


def test_a_tenant_salt_is_a_hash_never_the_key():
    salt = tenant_salt("secret-key")
    assert "secret-key" not in salt
    assert salt == tenant_salt("secret-key") != tenant_salt("secret-key2")


def test_the_engine_salt_puts_the_tenant_in_front_of_the_requests_own():
    assert engine_salt(None, None) is None
    assert engine_salt(None, "s") == "s"
    assert engine_salt("tenant-1", None) == "tenant-1"
    assert engine_salt("tenant-1", "s") == "tenant-1:s"
