"""Disk tier: survives restarts, verifies every record, never serves a bad or foreign one, turns itself off
when the directory cannot take writes, and stays within its size in LRU order."""

import errno
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from prefixcache.offload import DiskStore
from prefixcache.offload import disk as disk_module
from tests.offload.conftest import (
    RETAINED,
    WallClock,
    block_hash,
    blocks,
    check_held_prefix_reads_nothing,
    check_retention_order,
    forger,
    keyed_layout,
    make_layout,
    payload,
    retained_record_bytes,
)

REPO = Path(__file__).resolve().parents[2]


def hashes(*ids):
    return [block_hash(i) for i in ids]


def test_round_trip_is_exact(layout, tmp_path):
    store = DiskStore(layout, tmp_path, capacity_bytes=2**20)
    store.store(blocks(layout, [0, 1, 2]))
    assert store.load_prefix(hashes(0, 1, 2, 3)) == [payload(layout, i) for i in (0, 1, 2)]
    assert store.load_prefix(hashes(5, 0)) == []
    stats = store.snapshot()
    assert (stats.blocks_stored, stats.hits, stats.num_blocks, stats.bad_records) == (3, 3, 3, 0)


def test_blocks_survive_a_restart_with_their_lru_order(layout, tmp_path):
    record_bytes = len(disk_module.encode_record(layout, block_hash(0), payload(layout, 0)))
    first = DiskStore(layout, tmp_path, capacity_bytes=3 * record_bytes)
    first.store(blocks(layout, [1, 2, 3]))
    assert first.load_prefix(hashes(1)) == [payload(layout, 1)]  # 2 is now the least recently used
    first.close()

    restarted = DiskStore(layout, tmp_path, capacity_bytes=3 * record_bytes)
    assert restarted.snapshot().num_blocks == 3
    assert restarted.load_prefix(hashes(1)) == [payload(layout, 1)]
    restarted.store(blocks(layout, [4]))
    assert restarted.load_prefix(hashes(2)) == []
    assert [restarted.load_prefix([h]) != [] for h in hashes(1, 3, 4)] == [True, True, True]


def test_restart_with_a_smaller_capacity_evicts_the_oldest(layout, tmp_path):
    record_bytes = len(disk_module.encode_record(layout, block_hash(0), payload(layout, 0)))
    first = DiskStore(layout, tmp_path, capacity_bytes=4 * record_bytes)
    first.store(blocks(layout, [1, 2, 3, 4]))
    first.close()
    smaller = DiskStore(layout, tmp_path, capacity_bytes=2 * record_bytes)
    assert smaller.snapshot().num_blocks == 2
    assert smaller.load_prefix(hashes(3, 4)) == [payload(layout, 3), payload(layout, 4)]
    assert not (smaller.path_of(block_hash(1)).exists() or smaller.path_of(block_hash(2)).exists())


def test_held_prefix_reads_nothing_and_leaves_the_lru_order(layout, tmp_path):
    record_bytes = len(disk_module.encode_record(layout, block_hash(0), payload(layout, 0)))
    check_held_prefix_reads_nothing(DiskStore(layout, tmp_path, capacity_bytes=3 * record_bytes), layout)


def test_capacity_evicts_least_recently_used_files(layout, tmp_path):
    record_bytes = len(disk_module.encode_record(layout, block_hash(0), payload(layout, 0)))
    store = DiskStore(layout, tmp_path, capacity_bytes=3 * record_bytes)
    store.store(blocks(layout, [1, 2, 3]))
    store.load_prefix(hashes(1))
    store.store(blocks(layout, [4, 5]))
    held = [i for i in range(1, 6) if store.path_of(block_hash(i)).exists()]
    assert held == [1, 4, 5]
    stats = store.snapshot()
    assert (stats.evictions, stats.num_blocks, stats.used_bytes) == (2, 3, 3 * record_bytes)


def test_corrupt_and_truncated_files_are_misses_counted_deleted_and_logged_once(layout, tmp_path, caplog):
    store = DiskStore(layout, tmp_path, capacity_bytes=2**20)
    store.store(blocks(layout, [1, 2, 3, 4]))
    for i in (1, 3):
        path = store.path_of(block_hash(i))
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    for i in (2, 4):
        path = store.path_of(block_hash(i))
        path.write_bytes(path.read_bytes()[:-7])
    with caplog.at_level(logging.WARNING):
        for i in (1, 2, 3, 4):
            assert store.load_prefix(hashes(i)) == []
    assert store.snapshot().bad_records == 4
    assert not any(store.path_of(block_hash(i)).exists() for i in (1, 2, 3, 4))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "corrupt" in warnings[0] and "truncated" in warnings[1]
    store.store(blocks(layout, [1]))
    assert store.load_prefix(hashes(1)) == [payload(layout, 1)]


def test_a_corrupt_block_ends_the_run(layout, tmp_path):
    store = DiskStore(layout, tmp_path, capacity_bytes=2**20)
    store.store(blocks(layout, [1, 2, 3]))
    store.path_of(block_hash(2)).write_bytes(b"")
    assert store.load_prefix(hashes(1, 2, 3)) == [payload(layout, 1)]


def test_foreign_model_dtype_or_block_size_never_loads(layout, tmp_path):
    first = DiskStore(layout, tmp_path, capacity_bytes=2**20)
    first.store(blocks(layout, [1]))
    for change in ({"model_fingerprint": "other"}, {"dtype": "float16"}, {"block_size": 8}):
        other_layout = make_layout(**change)
        other = DiskStore(other_layout, tmp_path, capacity_bytes=2**20)
        assert other.snapshot().num_blocks == 0
        assert other.load_prefix(hashes(1)) == []


def test_a_foreign_file_under_the_right_name_is_a_miss(layout, tmp_path):
    other_layout = make_layout(model_fingerprint="other")
    other = DiskStore(other_layout, tmp_path, capacity_bytes=2**20)
    other.store(blocks(other_layout, [1]))
    store = DiskStore(layout, tmp_path, capacity_bytes=2**20)
    target = store.path_of(block_hash(1))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(other.path_of(block_hash(1)).read_bytes())
    store.close()
    restarted = DiskStore(layout, tmp_path, capacity_bytes=2**20)
    assert restarted.load_prefix(hashes(1)) == []
    assert restarted.snapshot().bad_records == 1


def test_leftover_temporary_files_and_strays_are_ignored_at_start(layout, tmp_path):
    store = DiskStore(layout, tmp_path, capacity_bytes=2**20)
    store.store(blocks(layout, [1]))
    (store.directory / "tmp" / "dead.tmp").write_bytes(b"half a record")
    (store.directory / "ab").mkdir(exist_ok=True)
    (store.directory / "ab" / "notes.txt").write_text("not a block")
    store.close()
    restarted = DiskStore(layout, tmp_path, capacity_bytes=2**20)
    assert not (store.directory / "tmp" / "dead.tmp").exists()
    assert restarted.snapshot().num_blocks == 1
    assert restarted.load_prefix(hashes(1)) == [payload(layout, 1)]


def test_a_path_that_is_not_a_directory_turns_the_tier_off(layout, tmp_path, caplog):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with caplog.at_level(logging.ERROR):
        store = DiskStore(layout, not_a_dir, capacity_bytes=2**20)
    assert not store.available
    store.store(blocks(layout, [1]))
    assert store.load_prefix(hashes(1)) == []
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
    assert "turned off" in caplog.records[0].getMessage()


def _failing_open(error):
    real_open = open

    def fake_open(path, mode="r", *args, **kwargs):
        if "w" in mode:
            raise OSError(error, os.strerror(error), str(path))
        return real_open(path, mode, *args, **kwargs)

    return fake_open


def test_full_disk_or_read_only_directory_turns_the_tier_off_once(layout, tmp_path, caplog, monkeypatch):
    for error in (errno.ENOSPC, errno.EROFS):
        store = DiskStore(layout, tmp_path / str(error), capacity_bytes=2**20)
        store.store(blocks(layout, [1]))
        monkeypatch.setattr(disk_module, "open", _failing_open(error), raising=False)
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            store.store(blocks(layout, [2, 3]))
            store.store(blocks(layout, [4]))
        monkeypatch.undo()
        assert not store.available
        assert store.load_prefix(hashes(1)) == []
        assert len(caplog.records) == 1 and os.strerror(error) in caplog.records[0].getMessage()
        assert list((store.directory / "tmp").iterdir()) == []


def test_other_write_errors_skip_the_block_and_keep_the_tier(layout, tmp_path, monkeypatch):
    store = DiskStore(layout, tmp_path, capacity_bytes=2**20)
    monkeypatch.setattr(disk_module, "open", _failing_open(errno.EIO), raising=False)
    store.store(blocks(layout, [1]))
    monkeypatch.undo()
    store.store(blocks(layout, [2]))
    assert store.available
    assert store.load_prefix(hashes(1)) == [] and store.load_prefix(hashes(2)) == [payload(layout, 2)]
    assert store.snapshot().errors == 1


def test_with_a_secret_forged_records_are_misses_deleted_and_stored_again(tmp_path):
    layout = keyed_layout()
    store = DiskStore(layout, tmp_path, capacity_bytes=2**20)
    store.store(blocks(layout, [1, 2]))
    for forger_secret in (None, b"a guessed secret of some length"):
        forged = disk_module.encode_record(forger(layout, forger_secret), block_hash(2), payload(layout, 9))
        store.path_of(block_hash(2)).write_bytes(forged)
        assert store.load_prefix(hashes(1, 2)) == [payload(layout, 1)]
        assert not store.path_of(block_hash(2)).exists()
        store.store(blocks(layout, [2]))
        assert store.load_prefix(hashes(1, 2)) == [payload(layout, 1), payload(layout, 2)]
    assert store.snapshot().bad_records == 2


def modes_under(root) -> dict[str, set[int]]:
    """The permission bits of every folder and file below ``root``, by kind."""
    found: dict[str, set[int]] = {"dirs": set(), "files": set()}
    for directory, subdirs, files in os.walk(root):
        found["dirs"] |= {stat.S_IMODE(os.stat(os.path.join(directory, d)).st_mode) for d in subdirs}
        found["files"] |= {stat.S_IMODE(os.stat(os.path.join(directory, f)).st_mode) for f in files}
    return found


def test_folders_are_0700_and_files_0600_under_a_permissive_umask(layout, tmp_path):
    root = tmp_path / "kv"
    old_umask = os.umask(0)
    try:
        store = DiskStore(layout, root, capacity_bytes=2**20)
        store.store(blocks(layout, [1, 2, 3]))
    finally:
        os.umask(old_umask)
    assert store.available and store.load_prefix(hashes(1, 2, 3)) == [payload(layout, i) for i in (1, 2, 3)]
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    modes = modes_under(root)
    assert modes == {"dirs": {0o700}, "files": {0o600}}
    assert len(list(store.directory.glob("*/*.kv"))) == 3


def test_a_namespace_folder_made_wider_is_narrowed_when_opened(layout, tmp_path):
    first = DiskStore(layout, tmp_path, capacity_bytes=2**20)
    first.store(blocks(layout, [1]))
    first.close()
    first.directory.chmod(0o755)
    restarted = DiskStore(layout, tmp_path, capacity_bytes=2**20)
    assert stat.S_IMODE(restarted.directory.stat().st_mode) == 0o700
    assert restarted.load_prefix(hashes(1)) == [payload(layout, 1)]


def test_a_directory_belongs_to_one_store_at_a_time(layout, tmp_path):
    record_bytes = len(disk_module.encode_record(layout, block_hash(0), payload(layout, 0)))
    first = DiskStore(layout, tmp_path, capacity_bytes=2 * record_bytes)
    first.store(blocks(layout, [1, 2]))
    with pytest.raises(ValueError, match=rf"in use by another engine \(pid {os.getpid()}\)"):
        DiskStore(layout, tmp_path, capacity_bytes=2 * record_bytes)
    other_model = DiskStore(make_layout(model_fingerprint="other"), tmp_path, capacity_bytes=2 * record_bytes)
    assert other_model.available  # another namespace in the same root is another directory
    first.store(blocks(layout, [3]))
    assert sum(f.stat().st_size for f in first.directory.glob("*/*.kv")) == 2 * record_bytes
    first.close()
    second = DiskStore(layout, tmp_path, capacity_bytes=2 * record_bytes)
    assert second.load_prefix(hashes(2, 3)) == [payload(layout, 2), payload(layout, 3)]


def test_another_process_cannot_take_the_directory_until_the_holder_exits(layout, tmp_path):
    holder = DiskStore(layout, tmp_path, capacity_bytes=2**20)
    script = (
        "import sys; from prefixcache.offload import DiskStore; from tests.offload.conftest import make_layout\n"
        "try:\n    DiskStore(make_layout(), sys.argv[1], 2**20)\nexcept ValueError as exc:\n    sys.exit(str(exc))\n"
    )
    refused = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert refused.returncode == 1 and f"in use by another engine (pid {os.getpid()})" in refused.stderr
    holder.close()
    taken = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert taken.returncode == 0, taken.stderr


def test_eviction_follows_priority_and_an_expired_record_is_never_loaded_and_deleted(layout, tmp_path):
    clock = WallClock()
    store = DiskStore(layout, tmp_path, 3 * retained_record_bytes(layout), wall_clock=clock)
    check_retention_order(store, layout, clock)
    assert not store.path_of(block_hash(1)).exists()


def test_a_retained_record_keeps_its_priority_and_expiry_across_a_restart(layout, tmp_path):
    clock = WallClock()
    capacity = 3 * retained_record_bytes(layout)
    store = DiskStore(layout, tmp_path, capacity, wall_clock=clock)
    store.store(blocks(layout, [1]), {block_hash(1): RETAINED})
    store.store(blocks(layout, [2, 3]))
    store.close()
    store = DiskStore(layout, tmp_path, capacity, wall_clock=clock)
    store.store(blocks(layout, [4]))  # block 1 is the oldest file, but retained: 2 goes
    assert [store.held_prefix(hashes(i)) != [] for i in (1, 2, 3, 4)] == [True, False, True, True]
    store.close()
    clock.now += RETAINED[1] + 1
    store = DiskStore(layout, tmp_path, capacity, wall_clock=clock)
    assert store.load_prefix(hashes(1)) == []
    assert not store.path_of(block_hash(1)).exists()
    store.close()
