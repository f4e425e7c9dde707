"""The model cache: file digests hashed once per file identity (a restart only stats the weights), and GGUF
conversions kept per content, shared by installations, never deleted under a process that uses them."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prefixcache.model import cache as cache_mod
from prefixcache.model import load_model
from prefixcache.model import loader as loader_mod
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


REPO = Path(__file__).resolve().parents[2]
# An engine in another process: resolves a GGUF (its conversion faked by copying the checkpoint folder given
# second), says which folder it uses, waits for a line on stdin, then loads the model from that folder.
READER = """
import shutil, sys
from pathlib import Path
from prefixcache.model import loader

def copy_checkpoint(source, out):
    for file in Path(sys.argv[2]).iterdir():
        shutil.copy(file, out / file.name)

loader._write_hf_checkpoint = copy_checkpoint
folder, _ = loader.resolve_model(sys.argv[1])
print(folder, flush=True)
sys.stdin.readline()
print(loader.load_model(folder).config.architecture, flush=True)
"""


class Reader:
    """A READER process; ``finish`` lets it load and checks that it did."""

    def __init__(self, gguf: Path, checkpoint: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", READER, str(gguf), str(checkpoint)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.folder = Path(self.process.stdout.readline().strip())

    def finish(self) -> None:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline().strip() == "LlamaForCausalLM"
        assert self.process.wait(timeout=60) == 0

    def reap(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=60)
        self.process.stdin.close()
        self.process.stdout.close()


def gguf_install(root: Path, content: bytes) -> Path:
    """A package's GGUF file as one installation (a virtualenv) holds it."""
    path = root / "lib" / "python3" / "site-packages" / "pkg" / "tiny-model.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


@pytest.fixture
def fake_gguf(tmp_path: Path, cache: Path, checkpoint_dirs, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Stand-in .gguf files whose "conversion" copies the tiny Llama checkpoint; counts conversions."""
    calls: list[Path] = []

    def fake_write(source: Path, out: Path) -> None:
        calls.append(source)
        if source.read_bytes() == b"crash":
            (out / "config.json").write_text("{}")
            raise RuntimeError("conversion crashed")
        for file in checkpoint_dirs["llama"].iterdir():
            shutil.copy(file, out / file.name)

    monkeypatch.setattr(loader_mod, "_write_hf_checkpoint", fake_write)
    return {"gguf": gguf_install(tmp_path / "venv-a", b"GGUF v1"), "calls": calls, "models": cache / "models"}


def folder_for(content: bytes) -> str:
    return f"tiny-model-{hashlib.sha256(content).hexdigest()[:16]}"


def test_gguf_is_converted_once_into_a_folder_named_by_its_content(fake_gguf) -> None:
    first = load_model(fake_gguf["gguf"])
    assert first.name == "tiny-model"
    assert first.model_dir == fake_gguf["models"] / folder_for(b"GGUF v1")
    assert (first.model_dir / "config.json").is_file()
    second = load_model(fake_gguf["gguf"])
    assert second.model_dir == first.model_dir
    assert len(fake_gguf["calls"]) == 1


def test_two_installations_of_one_file_share_one_folder(fake_gguf, tmp_path: Path) -> None:
    first = load_model(fake_gguf["gguf"])
    inode = first.model_dir.stat().st_ino
    other_install = gguf_install(tmp_path / "venv-b", b"GGUF v1")
    for _ in range(2):  # the installations take turns: neither "refreshes" the folder
        assert load_model(other_install).model_dir == first.model_dir
        assert load_model(fake_gguf["gguf"]).model_dir == first.model_dir
    assert len(fake_gguf["calls"]) == 1 and first.model_dir.stat().st_ino == inode
    assert [p.name for p in fake_gguf["models"].iterdir()] == [folder_for(b"GGUF v1")]


def test_a_changed_gguf_gets_a_new_folder_and_the_old_one_stays_while_in_use(fake_gguf) -> None:
    old = load_model(fake_gguf["gguf"]).model_dir  # this process now uses the old folder
    fake_gguf["gguf"].write_bytes(b"GGUF v2, longer")
    new = load_model(fake_gguf["gguf"]).model_dir
    assert new == fake_gguf["models"] / folder_for(b"GGUF v2, longer") and len(fake_gguf["calls"]) == 2
    assert (old / "config.json").is_file()
    assert load_model(old).config.architecture == "LlamaForCausalLM"


def test_crashed_conversion_leaves_nothing_behind(fake_gguf) -> None:
    fake_gguf["gguf"].write_bytes(b"crash")
    with pytest.raises(RuntimeError, match="crashed"):
        load_model(fake_gguf["gguf"])
    assert list(fake_gguf["models"].iterdir()) == []


def test_nothing_is_deleted_under_another_process_and_unused_stale_folders_go(
    fake_gguf, tmp_path: Path, checkpoint_dirs
) -> None:
    install_a = fake_gguf["gguf"]
    install_b = gguf_install(tmp_path / "venv-b", b"GGUF v1")
    readers: list[Reader] = []
    try:
        readers.append(Reader(install_b, checkpoint_dirs["llama"]))  # converts, then is "loading"
        old = readers[0].folder
        assert old == fake_gguf["models"] / folder_for(b"GGUF v1")
        inode = old.stat().st_ino
        readers.append(Reader(install_a, checkpoint_dirs["llama"]))  # the other installation starts meanwhile
        assert readers[1].folder == old and old.stat().st_ino == inode  # same folder, not converted again
        readers[1].finish()

        # both packages are upgraded and A starts, converting, while B's old engine is still loading
        install_a.write_bytes(b"GGUF v2, upgraded")
        install_b.write_bytes(b"GGUF v2, upgraded")
        assert loader_mod.resolve_model(install_a)[0] == fake_gguf["models"] / folder_for(b"GGUF v2, upgraded")
        assert old.stat().st_ino == inode and (old / "model.safetensors").is_file()
        readers[0].finish()
    finally:
        for reader in readers:
            reader.reap()

    # nobody uses the old folder now: the next conversion removes it and keeps the current ones
    loader_mod.resolve_model(gguf_install(tmp_path / "venv-c", b"GGUF v3, another model"))
    assert sorted(p.name for p in fake_gguf["models"].iterdir()) == sorted(
        [folder_for(b"GGUF v2, upgraded"), folder_for(b"GGUF v3, another model")]
    )
