"""KV events: the recorder against the pool, manager and stores it listens to, and the
publisher's frames decoded as vLLM's subscribers decode them (live, replayed, secured)."""

import time
from typing import Any

import msgpack
import msgspec
import pytest
import zmq

from hetserve.core.block_hash import BlockHash
from hetserve.core.kv_events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    MEDIUM_POOL,
    BlockRemoved,
    BlockStored,
)
from hetserve.core.request import Request
from hetserve.core.sampling import SamplingParams
from hetserve.disagg.kv_publisher import KVEventPublisher
from hetserve.disagg.kv_wire import END_SEQ, secure_client
from hetserve.errors import InvalidInputError
from hetserve.kv.events import KVEventRecorder
from hetserve.kv.manager import KVCacheManager
from hetserve.store import open_store
from hetserve.store.api import TierInfo

BS = 4


# ---- vLLM's subscriber side, as vllm/distributed/kv_events.py declares the structs (map events
# since vllm-project/vllm#42892, fields it added later with defaults included) -----------------
class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VBlockRemoved(VEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(VEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=VKVEventBatch)


# ---- helpers ----------------------------------------------------------------------------------
def compute(kv: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    """A request whose prompt was computed and registered in the prefix cache."""
    req = Request(rid, tokens, SamplingParams(max_tokens=1))
    assert kv.allocate_slots(req, len(tokens)) is not None
    req.num_computed_tokens = len(tokens)
    kv.cache_computed(req)
    return req


@pytest.fixture
def recorded():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    rec = KVEventRecorder(BS)
    rec.attach_cache(kv)
    return kv, rec


def publisher(rec, endpoint="tcp://127.0.0.1:0", **kw):
    return KVEventPublisher(rec, endpoint, interval_s=0.002, **kw)


def subscribe(pub, topic=b"kv-events", token=None):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    if token is not None:
        secure_client(sub, token)
    sub.connect(pub.endpoint.replace("0.0.0.0", "127.0.0.1"))
    sub.subscribe(topic)
    time.sleep(0.3)  # ZMQ's slow joiner: a subscription takes a moment to reach the publisher
    return sub


def receive(sub, timeout_ms=5000):
    """(seq, batch) of one PUB message, decoded as vLLM's example subscriber does."""
    assert sub.poll(timeout_ms), "no KV event batch arrived"
    topic, seq_bytes, payload = sub.recv_multipart()
    assert topic == b"kv-events"
    return int.from_bytes(seq_bytes, "big"), DECODER.decode(payload)


def replay(pub, start, kind=zmq.DEALER):
    """The replay socket's answer to `start`: [(seq, batch)] up to the end marker."""
    sock = zmq.Context.instance().socket(kind)
    sock.linger = 0
    sock.connect(pub.replay_endpoint)
    sock.send_multipart(
        [b"", start.to_bytes(8, "big")] if kind == zmq.DEALER else [start.to_bytes(8, "big")]
    )
    out = []
    while sock.poll(2000):
        frames = sock.recv_multipart()
        seq_bytes, payload = frames[-2:]
        if seq_bytes == END_SEQ:
            assert payload == b""
            break
        out.append((int.from_bytes(seq_bytes, "big"), DECODER.decode(payload)))
    sock.close()
    return out


# ---- the recorder -----------------------------------------------------------------------------
def test_device_blocks_stored_as_one_run_and_evicted(recorded):
    kv, rec = recorded
    req = compute(kv, "r", list(range(10)))  # two full blocks and a partial one
    h0, h1 = req.block_hashes
    assert rec.take() == [
        BlockStored([h0.digest, h1.digest], None, list(range(8)), BS, None, MEDIUM_GPU, None)
    ]
    kv.free(req)
    compute(kv, "s", list(range(100, 120)))  # five blocks: the pool hands out both cached ones
    events = rec.take()
    assert BlockRemoved([h1.digest, h0.digest], MEDIUM_GPU) in events  # tail first
    assert [e for e in events if isinstance(e, BlockStored)][0].parent_block_hash is None


def test_a_continuation_names_its_parent_and_a_reset_removes(recorded):
    kv, rec = recorded
    req = compute(kv, "r", list(range(4)))
    req.output_token_ids += [7, 8, 9, 10]  # a decode filled block 1 with generated tokens
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 0) is not None
    kv.cache_computed(req)
    (first,) = rec.take()
    assert first.block_hashes == [req.block_hashes[0].digest, req.block_hashes[1].digest]
    assert first.token_ids == [0, 1, 2, 3, 7, 8, 9, 10]
    kv.free(req)
    assert kv.pool.drop_cached() == 2
    assert rec.take() == [BlockRemoved([b.digest for b in req.block_hashes][::-1], MEDIUM_GPU)]


def test_local_store_placements_become_cpu_and_disk_events(tmp_path):
    rec = KVEventRecorder(BS)
    store = open_store(f"local://?dram=8K&ssd_dir={tmp_path}&ssd=64K&prefault=0")
    assert rec.attach_tiers(store, []) == "placements"
    keys = [bytes([i]) * 32 for i in range(3)]
    for k in keys:
        store.put(k, b"x" * 3000)  # two fit in DRAM: the third spills the oldest to SSD
    store.put("hetserve-probe-0", b"y")  # not a block: no event
    assert rec.take() == [
        BlockStored([keys[0]], None, [], BS, None, MEDIUM_CPU, None),
        BlockStored([keys[1]], None, [], BS, None, MEDIUM_CPU, None),
        BlockRemoved([keys[0]], MEDIUM_CPU),
        BlockStored([keys[0]], None, [], BS, None, MEDIUM_DISK, None),
        BlockStored([keys[2]], None, [], BS, None, MEDIUM_CPU, None),
    ]
    assert store.get(keys[0]) is not None  # promoted from SSD, spilling the next LRU one
    events = rec.take()
    assert BlockRemoved([keys[0]], MEDIUM_DISK) in events
    assert BlockStored([keys[0]], None, [], BS, None, MEDIUM_CPU, None) in events
    store.remove(keys[2])
    assert rec.take()[-1] == BlockRemoved([keys[2]], MEDIUM_CPU)
    store.close()


class _SharedStore:
    """A store that cannot tell where its objects go (as pool, Mooncake and Redis)."""

    def watch(self, listener):
        return False

    def tiers(self):
        return [TierInfo("pool", None, None, shared=True)]


def test_a_shared_store_is_followed_through_the_saves():
    rec, on_saved = KVEventRecorder(BS), []
    assert "POOL" in rec.attach_tiers(_SharedStore(), on_saved)
    h = BlockHash(b"\x01" * 32)
    on_saved[0]([h])
    assert rec.take() == [BlockStored([h.digest], None, [], BS, None, MEDIUM_POOL, None)]


# ---- the publisher ------------------------------------------------------------------------------
def test_frames_decode_as_vllm_decodes_them(recorded):
    kv, rec = recorded
    pub = publisher(rec)
    sub = subscribe(pub)
    try:
        req = compute(kv, "r", list(range(9)))
        seq, batch = receive(sub)
        assert seq == 0 and batch.data_parallel_rank == 0 and batch.ts > 0
        (ev,) = batch.events
        assert isinstance(ev, VBlockStored) and ev.medium == "GPU" and ev.block_size == BS
        assert ev.block_hashes == [h.digest for h in req.block_hashes]
        assert ev.parent_block_hash is None and ev.token_ids == list(range(8))
        assert ev.lora_id is None and ev.lora_name is None and ev.extra_keys is None
        rec.cleared()
        seq, batch = receive(sub)
        assert seq == 1 and isinstance(batch.events[0], VAllBlocksCleared)
        # The raw msgpack, read by a library that knows nothing of the structs: an array
        # batch of tagged maps whose keys come in vLLM's declaration order.
        _, raw = pub._buffer[0]
        ts, events, rank = msgpack.unpackb(raw)
        assert rank == 0 and list(events[0]) == [
            "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
            "medium", "lora_name",
        ]  # fmt: skip
    finally:
        sub.close()
        pub.close()


def test_replay_fills_a_gap_and_says_where_its_buffer_starts(recorded):
    kv, rec = recorded
    pub = publisher(rec, buffer_batches=3)
    try:
        for i in range(5):
            rec.cleared()
            deadline = time.monotonic() + 5
            while pub.snapshot()[0] < i and time.monotonic() < deadline:
                time.sleep(0.005)  # one batch each
        # A subscriber that saw batch 1 and then batch 4 (2 and 3 lost) asks from 2: the
        # buffer holds 2..4, so the gap is covered, then the end marker.
        assert [seq for seq, _ in replay(pub, 2)] == [2, 3, 4]
        # From 0 the buffer cannot cover it: the answer starts past what was asked for, which
        # is how a subscriber knows to resync from a snapshot.
        assert [seq for seq, _ in replay(pub, 0)][0] == 2
        assert replay(pub, 5) == []  # nothing new: only the end marker
        # vLLM's example subscriber asks from a REQ socket, which accepts the first reply only.
        assert [seq for seq, _ in replay(pub, 3, zmq.REQ)] == [3]
    finally:
        pub.close()


def test_snapshot_is_current_as_of_its_sequence_number(recorded):
    kv, rec = recorded
    pub = publisher(rec)
    try:
        req = compute(kv, "r", list(range(8)))
        deadline = time.monotonic() + 5
        while pub.snapshot()[0] < 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        seq, ts, blocks = pub.snapshot()
        assert seq == 0 and ts > 0
        assert blocks[MEDIUM_GPU] == [h.digest for h in req.block_hashes]
        assert blocks[MEDIUM_CPU] == blocks[MEDIUM_POOL] == []
    finally:
        pub.close()
    assert pub.snapshot()[2][MEDIUM_GPU] == []  # close() announced that nothing is held


def test_beyond_loopback_needs_the_token_and_curve_keeps_others_out(recorded):
    kv, rec = recorded
    with pytest.raises(InvalidInputError, match="token"):
        publisher(rec, "tcp://0.0.0.0:0")
    pub = publisher(rec, "tcp://0.0.0.0:0", token="s3cret")
    assert pub.describe()["curve"] is True
    good, plain, wrong = subscribe(pub, token="s3cret"), subscribe(pub), subscribe(pub, token="x")
    try:
        compute(kv, "r", list(range(8)))
        assert receive(good)[0] == 0
        assert not plain.poll(300) and not wrong.poll(300)
    finally:
        for s in (good, plain, wrong):
            s.close()
        pub.close()


def test_an_address_in_use_is_a_one_line_error(recorded):
    kv, rec = recorded
    first = publisher(rec)
    try:
        with pytest.raises(InvalidInputError, match="cannot bind"):
            publisher(KVEventRecorder(BS), first.endpoint)
    finally:
        first.close()
