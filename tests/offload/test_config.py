"""Offload options as users write them: sizes, PATH[:SIZE], Redis URLs with a capacity, the CLI flags."""

import argparse

import pytest
import redis

from prefixcache.config import EngineConfig
from prefixcache.engine.args import add_engine_args, engine_kwargs
from prefixcache.offload.config import (
    DEFAULT_DISK_BYTES,
    DEFAULT_REDIS_BYTES,
    REDIS_PASSWORD_ENV,
    SECRET_ENV,
    OffloadConfig,
    parse_disk_spec,
    parse_redis_spec,
    redacted_url,
)
from prefixcache.offload.record import RecordKey


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("/var/cache/kv:50GiB", ("/var/cache/kv", 50 * 2**30)),
        ("/var/cache/kv", ("/var/cache/kv", DEFAULT_DISK_BYTES)),
        ("/data/a:b", ("/data/a:b", DEFAULT_DISK_BYTES)),
        ("relative/dir:1.5GB", ("relative/dir", 1_500_000_000)),
    ],
)
def test_disk_spec(spec, expected):
    assert parse_disk_spec(spec) == expected


def test_redis_spec_takes_the_capacity_out_of_the_url():
    assert parse_redis_spec("redis://10.0.0.5:6379/2?capacity=1GiB") == ("redis://10.0.0.5:6379/2", 2**30)
    assert parse_redis_spec("redis://h:6379") == ("redis://h:6379", DEFAULT_REDIS_BYTES)
    assert parse_redis_spec("rediss://u:p@h:6379/0?capacity=2MiB&ssl_cert_reqs=none") == (
        "rediss://u:p@h:6379/0?ssl_cert_reqs=none",
        2 * 2**20,
    )
    with pytest.raises(ValueError, match="redis:// URL"):
        parse_redis_spec("localhost:6379")
    with pytest.raises(ValueError, match="capacity"):
        parse_redis_spec("redis://h:6379?capacity=much")


def test_flags_reach_the_engine_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        ["--kv-offload-cpu", "8GiB", "--kv-offload-disk", "/tmp/kv:1GiB", "--kv-offload-redis", "redis://r:6379/1"]
        + ["--kv-offload-mode", "write_through", "--kv-offload-min-priority", "36"]
    )
    offload = EngineConfig(**engine_kwargs(args)).offload_config()
    assert offload == OffloadConfig(
        8 * 2**30, "/tmp/kv", 2**30, "redis://r:6379/1", DEFAULT_REDIS_BYTES, "write_through", min_priority=36
    )
    assert not EngineConfig().offload_config().enabled


def test_bad_options_are_refused_by_the_engine_config():
    with pytest.raises(ValueError, match="kv_offload_cpu"):
        EngineConfig(kv_offload_cpu="0")
    with pytest.raises(ValueError, match="kv_offload_disk"):
        EngineConfig(kv_offload_disk=" ")
    with pytest.raises(ValueError, match="kv_offload_mode"):
        EngineConfig(kv_offload_mode="lazy")
    for priority in (-1, 101, 3.5, True):
        with pytest.raises(ValueError, match=r"kv_offload_min_priority must be an integer in \[0, 100\]"):
            EngineConfig(kv_offload_cpu="1GiB", kv_offload_min_priority=priority)


def test_the_secret_comes_from_the_file_flag_else_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert EngineConfig(kv_offload_disk=str(tmp_path)).offload_config().record_key is None
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-the-file-0123456789\n")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-offload-disk", str(tmp_path), "--kv-offload-secret-file", str(secret_file)])
    offload = EngineConfig(**engine_kwargs(args)).offload_config()
    assert offload.record_key == RecordKey(b"from-the-file-0123456789")
    assert "from-the-file" not in repr(offload) + repr(EngineConfig(**engine_kwargs(args)))
    monkeypatch.setenv(SECRET_ENV, "from-the-environment-0123")
    assert EngineConfig(kv_offload_disk=str(tmp_path)).offload_config().record_key == RecordKey(
        b"from-the-environment-0123"
    )
    assert offload == EngineConfig(**engine_kwargs(args)).offload_config()  # the file wins


def test_an_unreadable_or_short_secret_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    disk = str(tmp_path / "kv")
    with pytest.raises(ValueError, match="kv_offload_secret_file: cannot read"):
        EngineConfig(kv_offload_disk=disk, kv_offload_secret_file=str(tmp_path / "missing"))
    (tmp_path / "short").write_text("pin\n")
    with pytest.raises(ValueError, match=r"kv_offload_secret_file .*short: .* at least 16"):
        EngineConfig(kv_offload_redis="redis://r:6379", kv_offload_secret_file=str(tmp_path / "short"))
    monkeypatch.setenv(SECRET_ENV, "")
    with pytest.raises(ValueError, match=f"{SECRET_ENV}: .* at least 16"):
        EngineConfig(kv_offload_disk=disk)
    assert EngineConfig(kv_offload_cpu="1GiB").offload_config().record_key is None  # no shared tier reads it


def test_redis_tls_options_are_checked_before_anything_connects(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    url = f"rediss://h:6380/0?ssl_ca_certs={ca}&ssl_check_hostname=true"
    rebuilt, capacity = parse_redis_spec(url + "&capacity=1GiB")
    options = redis.connection.parse_url(rebuilt)  # what redis-py will connect with
    assert capacity == 2**30 and options["ssl_ca_certs"] == str(ca) and options["ssl_check_hostname"] is True
    for spec, error in [
        (f"redis://h:6379?ssl_ca_certs={ca}", "ssl_ca_certs is a TLS option, it needs a rediss:// URL"),
        (f"rediss://h:6379?ssl_ca_certs={tmp_path / 'missing.pem'}", "ssl_ca_certs: .*missing.pem not found"),
        (f"rediss://h:6379?ssl_ca_path={ca}", "ssl_ca_path: .* not found"),
        ("rediss://h:6379?ssl_cert_reqs=maybe", "ssl_cert_reqs must be one of none, optional, required"),
        ("redis://h:6379?sll_ca_certs=x", "unknown option 'sll_ca_certs'; known: capacity, client_name"),
    ]:
        with pytest.raises(ValueError, match=error):
            EngineConfig(kv_offload_redis=spec)


def test_passwords_never_reach_a_log_line_or_a_repr(monkeypatch):
    assert redacted_url("rediss://kv:s3cret@h:6380/0?ssl_password=k3y&db=1") == (
        "rediss://kv:***@h:6380/0?ssl_password=%2A%2A%2A&db=1"
    )
    assert redacted_url("redis://:s3cret@h:6379") == "redis://:***@h:6379"
    assert redacted_url("redis://h:6379/0") == "redis://h:6379/0"
    with pytest.raises(ValueError) as refused:
        parse_redis_spec("http://:s3cret@h:6379")
    assert "s3cret" not in str(refused.value)
    monkeypatch.setenv(REDIS_PASSWORD_ENV, "from-the-env")
    assert EngineConfig(kv_offload_redis="redis://kv@h:6379").offload_config().redis_password == "from-the-env"
    assert EngineConfig(kv_offload_redis="redis://kv:url@h:6379").offload_config().redis_password is None
    assert "from-the-env" not in repr(EngineConfig(kv_offload_redis="redis://kv@h:6379").offload_config())
