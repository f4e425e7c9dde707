"""The background writer: stores what it is given off the caller's thread, drops batches instead of making
the caller wait when the tiers fall behind, and finishes its queue when closed."""

import threading

from prefixcache.offload import HostMemoryStore
from prefixcache.offload.connector import TierWriter
from tests.offload.conftest import block_hash, blocks, payload


class SlowStore(HostMemoryStore):
    """A host store whose writes wait until the test lets them go."""

    def __init__(self, layout) -> None:
        super().__init__(layout, 2**20)
        self.entered = threading.Event()
        self.release = threading.Event()

    def _store(self, items, retention):
        self.entered.set()
        self.release.wait(timeout=30)
        return super()._store(items, retention)


def test_background_writes_land_after_flush_and_close_stops_the_thread(layout):
    store = HostMemoryStore(layout, 2**20)
    writer = TierWriter([store], max_pending_batches=4)
    writer.submit([0], blocks(layout, [1, 2]))
    writer.flush()
    assert store.load_prefix([block_hash(1), block_hash(2)]) == [payload(layout, 1), payload(layout, 2)]
    writer.submit([0], blocks(layout, [3]))
    thread = writer._thread
    writer.close()
    assert not thread.is_alive()
    assert block_hash(3) in store


def test_a_full_queue_drops_batches_instead_of_stalling_the_caller(layout):
    store = SlowStore(layout)
    writer = TierWriter([store], max_pending_batches=1)
    try:
        writer.submit([0], blocks(layout, [1]))
        assert store.entered.wait(timeout=30)  # the writer is busy with batch 1
        writer.submit([0], blocks(layout, [2]))  # waits in the queue
        writer.submit([0], blocks(layout, [3]))  # no room: dropped, the caller goes on
        assert writer.dropped_batches == 1
    finally:
        store.release.set()
        writer.close()
    assert [block_hash(i) in store for i in (1, 2, 3)] == [True, True, False]


def test_a_failing_tier_does_not_stop_the_writer(layout, caplog):
    class BrokenStore(HostMemoryStore):
        def _store(self, items, retention):
            raise RuntimeError("tier bug")

    good = HostMemoryStore(layout, 2**20)
    writer = TierWriter([BrokenStore(layout, 2**20), good])
    try:
        writer.submit([0], blocks(layout, [1]))
        writer.submit([1], blocks(layout, [2]))
        writer.flush()
    finally:
        writer.close()
    assert block_hash(2) in good
    assert "storing a batch failed" in caplog.text
