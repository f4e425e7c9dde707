"""The block pool's listener interface: what the KV events, tiers and the sub-block index build on."""

from prefixcache.core import KVCacheManager
from prefixcache.core.block_pool import BlockPoolListener, StoredBlocks
from tests.core.conftest import BLOCK_SIZE, admit, make_request, unique_tokens


class Recorder(BlockPoolListener):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def blocks_stored(self, stored: StoredBlocks) -> None:
        self.calls.append(("stored", stored))

    def blocks_removed(self, block_hashes, group) -> None:
        self.calls.append(("removed", list(block_hashes)))

    def cache_cleared(self) -> None:
        self.calls.append(("cleared",))


def make_manager(num_blocks: int = 10) -> tuple[KVCacheManager, Recorder]:
    recorder = Recorder()
    manager = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, listeners=[recorder])
    return manager, recorder


def test_full_blocks_are_reported_once_as_one_run_with_tokens_and_parent():
    manager, recorder = make_manager()
    request = make_request(unique_tokens(10, 0), cache_salt="tenant")
    admit(manager, request)
    hashes = manager.block_hashes(request)
    [(kind, stored)] = recorder.calls
    assert kind == "stored"
    assert stored.block_hashes == hashes[:2]
    assert stored.parent_block_hash is None
    assert stored.token_ids == unique_tokens(8, 0)
    assert stored.block_size == BLOCK_SIZE
    assert stored.extra_keys == [(("salt", "tenant"),), None]


def test_a_hit_is_not_reported_again_and_new_blocks_name_their_parent():
    manager, recorder = make_manager()
    admit(manager, make_request(unique_tokens(9, 0)))
    recorder.calls.clear()
    second = make_request(unique_tokens(8, 0) + unique_tokens(5, 100))
    assert admit(manager, second) == 8
    hashes = manager.block_hashes(second)
    [(_, stored)] = recorder.calls
    assert stored.block_hashes == [hashes[2]]
    assert stored.parent_block_hash == hashes[1]
    assert stored.token_ids == [100, 101, 102, 103]


def removed(recorder: Recorder) -> list:
    return [h for call in recorder.calls if call[0] == "removed" for h in call[1]]


def test_a_shared_block_is_removed_when_reused_for_other_tokens():
    manager, recorder = make_manager(num_blocks=6)
    first, second = make_request(unique_tokens(5, 0)), make_request(unique_tokens(5, 0))
    admit(manager, first)
    assert admit(manager, second) == BLOCK_SIZE
    manager.free(first)
    manager.free(second)
    assert [c[0] for c in recorder.calls] == ["stored"]
    filler = make_request(unique_tokens(6 * BLOCK_SIZE, 1000))
    assert manager.allocate_slots(filler, filler.num_tokens - 1) is not None
    assert removed(recorder) == [manager.block_hashes(first)[0]]


def test_independent_duplicates_report_removal_only_for_the_last_copy():
    manager, recorder = make_manager(num_blocks=4)
    # Both requests are admitted before either is cached, so each fills its own copy of block 0.
    a, b = make_request(unique_tokens(5, 0)), make_request(unique_tokens(5, 0))
    for request in (a, b):
        assert manager.allocate_slots(request, 0) is not None
    for request in (a, b):
        manager.allocate_slots(request, request.num_tokens)
    block_hash = manager.block_hashes(a)[0]
    assert [c[0] for c in recorder.calls] == ["stored"]
    manager.free(a)
    manager.free(b)
    filler = make_request(unique_tokens(4 * BLOCK_SIZE, 1000))
    manager.allocate_slots(filler, 3 * BLOCK_SIZE)  # the two uncached blocks and one copy of block 0
    assert removed(recorder) == []
    manager.allocate_slots(filler, BLOCK_SIZE)  # the last copy goes
    assert removed(recorder) == [block_hash]


def test_reset_reports_cleared():
    manager, recorder = make_manager()
    request = make_request(unique_tokens(8, 0))
    admit(manager, request)
    manager.free(request)
    assert manager.reset_prefix_cache()
    assert recorder.calls[-1] == ("cleared",)
