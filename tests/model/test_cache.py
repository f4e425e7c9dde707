"""The model cache: file digests hashed once per file identity (a restart only stats the weights)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from prefixcache.model import cache as cache_mod
from prefixcache.model import load_model
from tests.helpers import wait_until


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files read for hashing, in order."""
    reads: list[str] = []
    real = hashlib.file_digest

    def counting(f, algo):
        reads.append(Path(f.name).name)
        return real(f, algo)

    monkeypatch.setattr(cache_mod.hashlib, "file_digest", counting)
    return reads


def test_a_file_is_hashed_once_per_identity(cache: Path, tmp_path: Path, hashed: list[str]) -> None:
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"w" * 1000)
    assert cache_mod.file_digest(weights) == hashlib.sha256(b"w" * 1000).hexdigest()
    assert cache_mod.file_digest(tmp_path / "." / "weights.bin") == hashlib.sha256(b"w" * 1000).hexdigest()
    assert hashed == ["weights.bin"]
    assert (cache / "digests").stat().st_mode & 0o777 == 0o700


def test_a_rewrite_with_the_old_size_and_mtime_is_hashed_again(cache: Path, tmp_path: Path, hashed) -> None:
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"a" * 1000)
    before = weights.stat()
    first = cache_mod.file_digest(weights)
    probe = tmp_path / "probe"  # file times tick coarsely: make sure the rewrite falls in a later tick
    wait_until(lambda: probe.write_bytes(b"") == 0 and probe.stat().st_ctime_ns != before.st_ctime_ns)
    with open(weights, "r+b") as f:  # in place: same inode, same size
        f.write(b"b")
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert cache_mod.file_digest(weights) == hashlib.sha256(b"b" + b"a" * 999).hexdigest() != first
    assert hashed == ["weights.bin", "weights.bin"]


def test_entries_of_deleted_files_are_dropped(cache: Path, tmp_path: Path) -> None:
    gone, kept = tmp_path / "gone.bin", tmp_path / "kept.bin"
    gone.write_bytes(b"1")
    cache_mod.file_digest(gone)
    gone.unlink()
    kept.write_bytes(b"2")
    cache_mod.file_digest(kept)
    assert len(list((cache / "digests").glob("*.json"))) == 1


def test_an_unusable_cache_only_costs_the_hashing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hashed) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(blocker))
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"x")
    assert cache_mod.file_digest(weights) == cache_mod.file_digest(weights) == hashlib.sha256(b"x").hexdigest()
    assert len(hashed) == 2


def test_a_restart_loads_without_hashing_the_weights_again(cache: Path, checkpoint_dirs, hashed) -> None:
    first = load_model(checkpoint_dirs["llama"])
    second = load_model(checkpoint_dirs["llama"])
    assert first.weights_digest == second.weights_digest
    assert hashed == ["model.safetensors"]
    assert load_model(checkpoint_dirs["qwen2_tied"]).weights_digest != first.weights_digest
