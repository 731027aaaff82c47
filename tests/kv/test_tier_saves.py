"""The KV tiers' saver (kv/tier_saves.py) on its own: a block evicted again (recomputed
meanwhile, so the same identity) while its first copy still waits to be saved is staged and
saved once; a block whose save failed is staged again; the victim cache's two maps stay in step.
A fake store and staging area record what reaches them."""

import threading
import time

import pytest

from hetserve.core.block_hash import hash_block_tokens
from hetserve.kv.manager import KVCacheManager
from hetserve.kv.tier_blocks import TierBlocks
from hetserve.kv.tier_saves import Saver


class FakeIO:
    bytes_per_block = 4
    num_parts = 1
    staging_slots = 8

    def __init__(self) -> None:
        self.staged: list[tuple[int, int]] = []  # (block id, slot)

    def stage(self, block_ids, slots):
        self.staged += zip(block_ids, slots, strict=True)

    def staged_parts(self, slots):
        return [[bytes([s]) * 4] for s in slots]


class FakeStore:
    def __init__(self) -> None:
        self.gate = threading.Event()  # saves wait until the test lets them through
        self.puts: list[bytes] = []
        self.fail = False

    def batch_put_parts(self, keys, parts, cfg=None):
        assert self.gate.wait(10)
        if self.fail:
            raise ConnectionError("store down")
        self.puts += keys


@pytest.fixture
def saver():
    kv = KVCacheManager(num_blocks=4, block_size=4)  # 3 usable blocks
    store = FakeStore()
    s = Saver(store, TierBlocks(kv), FakeIO(), max_pending=64)
    yield s, kv.pool, store
    store.gate.set()
    s.close()


def evict_cached(pool, h):
    """Cache a block under `h`, free it, then hand every block out: `h`'s is evicted."""
    b = pool.allocate(1)[0]
    pool.cache(b, h)
    pool.free([b])
    taken = pool.allocate(pool.num_free)
    pool.free(taken)


def wait_saves(s):
    s.pump()
    deadline = time.monotonic() + 10
    while s.pending() and time.monotonic() < deadline:
        s.pump()
        time.sleep(0.001)
    assert not s.pending()


def test_a_block_evicted_twice_before_its_save_is_saved_once(saver):
    s, pool, store = saver
    h = hash_block_tokens(None, [1, 2, 3, 4])
    evict_cached(pool, h)
    s.capture()
    s.pump()  # the first copy goes to the saver thread, which waits at the store
    evict_cached(pool, h)  # recomputed and evicted again meanwhile
    s.capture()
    s.check_integrity()
    assert len(s.io.staged) == 1
    store.gate.set()
    wait_saves(s)
    s.check_integrity()
    assert store.puts == [h.digest] and s.saved == 1


def test_a_block_whose_save_failed_is_staged_again_and_found_in_its_new_slot(saver):
    s, pool, store = saver
    store.fail = True
    store.gate.set()
    h = hash_block_tokens(None, [1, 2, 3, 4])
    evict_cached(pool, h)
    s.capture()
    first = s.staged_run([h])
    wait_saves(s)
    assert s.failed == 1 and s.staged_run([h]) == first  # the failed copy stays a victim copy
    evict_cached(pool, h)
    s.capture()  # not in the store, not in flight: staged again, in another slot
    s.check_integrity()
    again = s.staged_run([h])
    assert again and again != first


def test_a_staged_copy_shed_while_its_block_is_evicted_again_is_staged_anew(saver):
    """Two staging slots: h is staged; then g, k and h are evicted in one pass. Room for the
    new copies sheds h's staged one, so h's fresh eviction (its bytes still in place) is staged
    in its stead, not dropped as a duplicate of a copy that no longer waits."""
    s, pool, store = saver
    s.io.staging_slots = 2
    s._free_slots.clear()
    s._free_slots.extend([0, 1])
    h, g, k = (hash_block_tokens(None, [t] * 4) for t in (1, 2, 3))
    evict_cached(pool, h)
    s.capture()
    for x in (g, k, h):
        b = pool.allocate(1)[0]
        pool.cache(b, x)
        pool.free([b])
    pool.free(pool.allocate(pool.num_free))  # all three handed out: evicted in one pass
    s.capture()
    s.check_integrity()
    assert s.staged_run([h]) and h in s._in_flight
