"""The KV event subscriber against a real publisher: a lost batch is replayed, a gap the replay
buffer cannot cover and a batch that does not decode are resynced from the snapshot, and the
index ends up holding exactly what the publisher says the instance holds."""

import time

import pytest

from hetserve.core.kv_events import MEDIUM_GPU
from hetserve.core.request import Request
from hetserve.core.sampling import SamplingParams
from hetserve.disagg.kv_publisher import KVEventPublisher
from hetserve.disagg.kv_subscriber import KVEventSubscriber
from hetserve.kv.events import KVEventRecorder
from hetserve.kv.manager import KVCacheManager

BS = 4


class Instance:
    """A KV cache with a recorder and a publisher, as an engine has them, and its /internal
    routes answered directly (`fetch`)."""

    def __init__(self, buffer_batches=10_000):
        self.buffer_batches = buffer_batches
        self.n = 0
        self.start()

    def start(self):
        self.kv = KVCacheManager(num_blocks=10, block_size=BS)
        rec = KVEventRecorder(BS)
        rec.cleared()
        rec.attach_cache(self.kv)
        self.pub = KVEventPublisher(  # port 0: a restart binds other ports
            rec, "tcp://127.0.0.1:0", interval_s=0.002, buffer_batches=self.buffer_batches
        )

    def fetch(self, base_url, path, token, timeout_s):
        if path == "/internal/kv_info":
            return {"block_size": BS, "kv_events": self.pub.describe()}
        seq, ts, blocks = self.pub.snapshot()
        return {
            "seq": seq,
            "ts": ts,
            "blocks": {m: [h.hex() for h in hs] for m, hs in blocks.items()},
        }

    def compute(self, tokens):
        """One request computed, registered and freed (its blocks stay cached until evicted);
        waits until the publisher numbered its batch."""
        self.n += 1
        req = Request(f"r{self.n}", tokens, SamplingParams(max_tokens=1))
        before = self.pub.snapshot()[0]
        assert self.kv.allocate_slots(req, len(tokens)) is not None
        req.num_computed_tokens = len(tokens)
        self.kv.cache_computed(req)
        self.kv.free(req)
        wait(lambda: self.pub.snapshot()[0] > before)
        return req

    def truth(self):
        return {h for h in self.pub.snapshot()[2][MEDIUM_GPU]}


def wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def inst():
    i = Instance()
    yield i
    i.pub.close()


def follow(inst, **kw):
    sub = KVEventSubscriber(fetch=inst.fetch, **{"replay_timeout_s": 2.0, **kw})
    sub.add("a", "http://127.0.0.1:1")
    wait(lambda: sub.applied().get("a", -2) >= inst.pub.snapshot()[0])
    time.sleep(0.3)  # ZMQ's slow joiner: let the subscription reach the publisher
    return sub


def caught_up(sub, inst):
    wait(lambda: sub.applied()["a"] >= inst.pub.snapshot()[0])
    return sub.index.blocks("a")[MEDIUM_GPU] == inst.truth()


def drop_live(sub, seqs):
    """Lose these live batches once (as a network would): the subscriber never sees them."""
    real = sub._on_batch
    lost = set(seqs)

    def on_batch(inst, seq, payload):
        if seq in lost:
            lost.discard(seq)
            return
        real(inst, seq, payload)

    sub._on_batch = on_batch


def test_follows_live_batches(inst):
    sub = follow(inst)
    try:
        # Nine usable blocks, two per request: the later requests evict the first ones.
        reqs = [inst.compute(list(range(100 * k, 100 * k + 8))) for k in range(6)]
        assert caught_up(sub, inst)
        last, first = ([h.digest for h in r.block_hashes] for r in (reqs[-1], reqs[0]))
        assert sub.holdings(last) == {"a": {"device": 2, "dram": 2, "ssd": 2}}
        assert sub.holdings(first) == {}  # evicted: BlockRemoved reached the index
        assert sub.stats()["a"].get("gaps", 0) == 0
    finally:
        sub.close()


def test_a_lost_batch_is_replayed(inst):
    sub = follow(inst)
    try:
        first = inst.pub.snapshot()[0] + 1
        drop_live(sub, [first + 1])
        reqs = [inst.compute(list(range(100 * k, 100 * k + 8))) for k in range(4)]
        assert caught_up(sub, inst)
        stats = sub.stats()["a"]
        assert stats["gaps"] == 1 and stats.get("resyncs") == 1  # the resync is the add's
        digests = [h.digest for h in reqs[-1].block_hashes]
        assert sub.holdings(digests) == {"a": {"device": 2, "dram": 2, "ssd": 2}}
    finally:
        sub.close()


def test_a_gap_past_the_replay_buffer_resyncs_from_the_snapshot():
    inst = Instance(buffer_batches=1)
    sub = follow(inst)
    try:
        first = inst.pub.snapshot()[0] + 1
        drop_live(sub, [first, first + 1])
        for k in range(4):
            inst.compute(list(range(100 * k, 100 * k + 8)))
        assert caught_up(sub, inst)
        assert sub.stats()["a"]["resyncs"] >= 2  # the add's, and the gap's
    finally:
        sub.close()
        inst.pub.close()


def test_a_batch_that_does_not_decode_is_never_applied(inst):
    sub = follow(inst)
    try:
        real = sub._on_batch
        bad = {inst.pub.snapshot()[0] + 1}

        def on_batch(i, seq, payload):
            real(i, seq, b"\xc1garbage" if seq in bad else payload)
            bad.discard(seq)

        sub._on_batch = on_batch
        for k in range(3):
            inst.compute(list(range(100 * k, 100 * k + 8)))
        assert caught_up(sub, inst)
        assert sub.stats()["a"]["undecodable"] == 1 and sub.stats()["a"]["resyncs"] >= 2
    finally:
        sub.close()


def test_an_instance_restarted_on_other_ports_is_found_again(inst):
    sub = follow(inst, probe_s=0.2, replay_timeout_s=0.3)
    try:
        inst.compute(list(range(8)))
        assert caught_up(sub, inst)
        inst.pub.close()  # killed; it comes back on other ports with an empty cache
        inst.start()
        req = inst.compute(list(range(50, 58)))
        wait(lambda: sub.stats()["a"].get("moved") == 1)
        # Reconnected; the resync of the restarted instance follows (its first batch, older by
        # number, newer by time, or a probe): until then the old numbers look caught up.
        wait(lambda: caught_up(sub, inst))
        digests = [h.digest for h in req.block_hashes]
        assert sub.holdings(digests) == {"a": {"device": 2, "dram": 2, "ssd": 2}}
        later = inst.compute(list(range(70, 78)))  # followed live again
        wait(lambda: "a" in sub.holdings([h.digest for h in later.block_hashes]))
    finally:
        sub.close()


def test_an_instance_without_kv_events_is_refused():
    sub = KVEventSubscriber()
    try:
        with pytest.raises(ConnectionError, match="no KV events"):
            sub.add("a", "http://127.0.0.1:1", info={"kv_events": None})
        with pytest.raises(ConnectionError, match="kv_info"):
            sub.add("b", "http://127.0.0.1:9")  # nothing listens there
    finally:
        sub.close()


def test_a_rejoined_instance_is_resynced_at_once(inst):
    # Probes far apart: only the Conductor's word that the instance is back finds it again.
    sub = follow(inst, probe_s=600.0, replay_timeout_s=0.3)
    try:
        inst.compute(list(range(8)))
        assert caught_up(sub, inst)
        inst.pub.close()  # restarted on other ports with an empty cache
        inst.start()
        req = inst.compute(list(range(50, 58)))
        sub.rejoined("a")
        wait(lambda: sub.stats()["a"].get("moved") == 1)
        assert caught_up(sub, inst)
        assert "a" in sub.holdings([h.digest for h in req.block_hashes])
    finally:
        sub.close()


def test_an_instance_away_is_said_once_not_every_probe(inst, caplog):
    """While an instance was down its snapshot was retried every probe with a warning each
    time (a line every 2 s); now once, and once more when it is taken again."""
    import logging

    sub = follow(inst, probe_s=600.0)
    away = {"on": True}
    real = sub._fetch

    def fetch(base_url, path, token, timeout_s):
        if away["on"] and path == "/internal/kv_snapshot":
            raise ConnectionError(f"{base_url} refused the connection")
        return real(base_url, path, token, timeout_s)

    try:
        sub._fetch = fetch
        with caplog.at_level(logging.WARNING, logger="hetserve.disagg.kv_subscriber"):
            for _ in range(5):
                sub._resync(sub._instances["a"])
            away["on"] = False
            sub._resync(sub._instances["a"])
        lines = [r.getMessage() for r in caplog.records]
        assert sum("KV snapshot of a failed" in m for m in lines) == 1, lines
        assert sum("taken again" in m for m in lines) == 1, lines
        assert sub.stats()["a"]["resync_failures"] == 5
    finally:
        sub.close()
