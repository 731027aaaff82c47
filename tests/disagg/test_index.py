"""The KV index against a brute-force model of the same event stream, with lost batches
resynced from snapshots as the subscriber does; exact holdings on hand-built states."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from hetserve.core.kv_events import (
    MEDIA,
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from hetserve.disagg.index import KVIndex

HASHES = [bytes([i]) * 32 for i in range(10)]
INSTANCES = ["a", "b", "c"]
LOCAL = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK)


def stored(medium, hashes):
    return BlockStored(list(hashes), None, [], 16, None, medium, None)


class Truth:
    """What the instances hold, by brute force: per instance a set per local medium, and the
    pool's blocks (announced by anyone; no store can announce a pool removal)."""

    def __init__(self):
        self.held = {i: {m: set() for m in LOCAL} for i in INSTANCES}
        self.pool = set()

    def apply(self, inst, events):
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                for m in LOCAL:
                    self.held[inst][m].clear()
            elif ev.medium == MEDIUM_POOL:
                self.pool |= set(ev.block_hashes)
            elif isinstance(ev, BlockStored):
                self.held[inst][ev.medium] |= set(ev.block_hashes)
            else:
                self.held[inst][ev.medium] -= set(ev.block_hashes)

    def snapshot(self, inst):
        return {**{m: set(s) for m, s in self.held[inst].items()}, MEDIUM_POOL: set(self.pool)}

    def holdings(self, query):
        out = {}
        for inst, media in self.held.items():
            covered = set()
            for medium, tier in zip(LOCAL, ("device", "dram", "ssd"), strict=True):
                covered |= media[medium]
                n = next((k for k, h in enumerate(query) if h not in covered), len(query))
                if n:
                    out.setdefault(inst, {})[tier] = n
        n = next((k for k, h in enumerate(query) if h not in self.pool), len(query))
        if n:
            out["pool"] = {"pool": n}
        return out


events = st.one_of(
    st.builds(stored, st.sampled_from(MEDIA), st.lists(st.sampled_from(HASHES), max_size=6)),
    st.builds(BlockRemoved, st.lists(st.sampled_from(HASHES), max_size=6), st.sampled_from(LOCAL)),
    st.just(AllBlocksCleared()),
)
batches = st.lists(
    st.tuples(st.sampled_from(INSTANCES), st.lists(events, max_size=4), st.booleans()),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(batches, st.randoms(use_true_random=False))
def test_index_matches_brute_force_with_lost_batches(stream, rnd):
    """Each batch is delivered or lost (the flag); an instance with a lost batch is reset from
    its snapshot before its next delivered batch (or at the end), as the subscriber does."""
    truth, index = Truth(), KVIndex()
    dirty = set()
    for inst, evs, lost in stream:
        truth.apply(inst, evs)
        if lost:
            dirty.add(inst)
            continue
        if inst in dirty:  # the snapshot is current as of this batch, which it includes
            index.reset(inst, truth.snapshot(inst))
            dirty.discard(inst)
        else:
            index.apply(inst, evs)
        index.check_integrity()
    for inst in dirty:
        index.reset(inst, truth.snapshot(inst))
    index.check_integrity()
    for inst in index.instances:
        assert index.blocks(inst) == truth.held[inst]
    assert index.pool_blocks() == truth.pool
    for _ in range(5):
        query = rnd.sample(HASHES, rnd.randint(0, len(HASHES)))
        assert index.holdings(query) == {
            h: t for h, t in truth.holdings(query).items() if h == "pool" or h in index.instances
        }


def test_holdings_are_cumulative_per_tier():
    index = KVIndex()
    index.mark("a", MEDIUM_GPU, HASHES[:2], True)
    index.mark("a", MEDIUM_DISK, HASHES[2:5], True)
    index.mark("a", MEDIUM_CPU, HASHES[1:3], True)  # block 1 in both GPU and CPU
    index.mark("b", MEDIUM_CPU, HASHES[:1] + HASHES[2:4], True)  # a hole at block 1
    index.mark("b", MEDIUM_POOL, HASHES[:3], True)
    assert index.holdings(HASHES) == {
        "a": {"device": 2, "dram": 3, "ssd": 5},
        "b": {"dram": 1, "ssd": 1},
        "pool": {"pool": 3},
    }
    assert index.holdings(HASHES[5:]) == {}
    assert index.holdings([]) == {}


def test_clear_and_drop_keep_the_pool():
    index = KVIndex()
    index.apply("a", [stored(MEDIUM_GPU, HASHES[:3]), stored(MEDIUM_POOL, HASHES[:2])])
    index.apply("a", [AllBlocksCleared()])
    assert index.holdings(HASHES) == {"pool": {"pool": 2}}
    index.drop("a")
    assert index.instances == [] and index.holdings(HASHES) == {"pool": {"pool": 2}}
    index.check_integrity()


def test_pool_blocks_are_bounded_oldest_announced_first():
    index = KVIndex(max_pool_blocks=3)
    index.mark("a", MEDIUM_POOL, HASHES[:4], True)
    assert index.pool_blocks() == set(HASHES[1:4])
    index.mark("b", MEDIUM_POOL, HASHES[1:2], True)  # announced again: the newest now
    index.mark("b", MEDIUM_POOL, HASHES[5:6], True)
    assert index.pool_blocks() == {HASHES[1], HASHES[3], HASHES[5]}
    index.check_integrity()


def test_unknown_media_are_ignored_and_counted():
    index = KVIndex()
    index.apply("a", [stored("STORAGE", HASHES[:2]), BlockRemoved(HASHES[:1], "TAPE")])
    assert index.ignored == 2 and index.holdings(HASHES) == {}


def test_more_instances_than_a_lane_holds():
    """Slots past the first lane width (64) repack every block: holdings stay exact."""
    rng = random.Random(0)
    index, truth = KVIndex(width=64), {}
    for i in range(150):
        n = rng.randrange(len(HASHES) + 1)
        index.mark(f"i{i}", rng.choice(LOCAL), HASHES[:n], True)
        truth[f"i{i}"] = n
    index.drop("i3")
    index.mark("late", MEDIUM_GPU, HASHES[:7], True)  # takes the freed slot
    truth.pop("i3")
    truth["late"] = 7
    index.check_integrity()
    got = index.holdings(HASHES)
    assert {name: max(t.values()) for name, t in got.items()} == {
        name: n for name, n in truth.items() if n
    }


def test_long_prompts_cross_the_first_chunk():
    """Prefixes ending before, at and after the first chunk's boundary (256 blocks)."""
    hashes = [i.to_bytes(32, "big") for i in range(1000)]
    index = KVIndex()
    for name, n in (("a", 100), ("b", 256), ("c", 257), ("d", 1000)):
        index.mark(name, MEDIUM_GPU, hashes[:n], True)
    index.mark("e", MEDIUM_CPU, hashes[:300], True)
    index.mark("e", MEDIUM_GPU, hashes[300:], True)  # a device run after a DRAM prefix
    held = index.holdings(hashes)
    for name, n in (("a", 100), ("b", 256), ("c", 257), ("d", 1000)):
        assert held[name] == {"device": n, "dram": n, "ssd": n}  # cumulative: faster counts
    assert held["e"] == {"dram": 1000, "ssd": 1000}
