"""An engine with KV events on: prompt blocks are announced when cached and removed when
evicted, a local store's blocks appear in CPU, and an index built from the events holds what
the engine's own pool and store hold."""

import time

import pytest

from hetserve import LLM, SamplingParams
from hetserve.core.block_hash import hash_prefix_blocks
from hetserve.core.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    decode_batch,
)
from hetserve.core.request import NewRequest
from hetserve.disagg.kv_subscriber import KVEventSubscriber

PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
BS = 16
PROMPTS = [list(range(10 + 100 * k, 10 + 100 * k + 70)) for k in range(4)]  # 4 full blocks each


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(
        tiny_model("qwen3-moe"),
        max_model_len=128,
        num_kv_blocks=12,  # 11 usable: the third prompt evicts the first one's blocks
        kv_events="tcp://127.0.0.1:0",
        kv_store="local://?dram=64M&prefault=0",
    )
    yield engine
    engine.close()


def wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def run(llm, rid, prompt):
    core = llm.engine
    core.submit(NewRequest(rid, prompt, PARAMS))
    while core.has_unfinished():
        core.step()
        core.check_integrity()
    for _ in range(200):  # let the saves land (the tiers' thread)
        if not core.background_work():
            break
        core.step()
        time.sleep(0.005)


def published(pub):
    """Every event the publisher sent so far (its replay buffer), decoded."""
    return [ev for _, payload in list(pub._buffer) for ev in decode_batch(payload).events]


def test_events_follow_the_pool_and_the_store(llm):
    core = llm.engine
    pub = core.kv_events

    def fetch(base_url, path, token, timeout_s):  # the /internal routes, answered here
        seq, ts, blocks = pub.snapshot()
        return {
            "seq": seq,
            "ts": ts,
            "blocks": {m: [h.hex() for h in b] for m, b in blocks.items()},
        }

    sub = KVEventSubscriber(fetch=fetch)
    sub.add("e", "http://127.0.0.1:1", info=core.kv_info())
    try:
        hashes = []
        for k, prompt in enumerate(PROMPTS):
            run(llm, f"r{k}", prompt)
            seed = bytes.fromhex(core.kv_info()["hash_seed"])
            hashes.append([h.digest for h in hash_prefix_blocks(prompt, BS, (), seed)])
        store = core.tiers.store  # write-back: what was evicted went to the store's DRAM

        def truth():
            pool = {b.block_hash.digest for b in core.kv.pool.blocks if b.block_hash is not None}
            saved = {h for hs in hashes for h in hs if store.batch_locate([h]) == ["dram"]}
            return {MEDIUM_GPU: pool, MEDIUM_CPU: saved}

        # The last saves land on the saver's thread: the index catches up a tick later.
        wait(lambda: {m: sub.index.blocks("e")[m] for m in (MEDIUM_GPU, MEDIUM_CPU)} == truth())
        assert truth()[MEDIUM_CPU]
        events = published(pub)
        stored = [h for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_GPU
                  for h in e.block_hashes]  # fmt: skip
        removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == MEDIUM_GPU
                   for h in e.block_hashes]  # fmt: skip
        first = next(e for e in events if isinstance(e, BlockStored))
        assert first.block_hashes == hashes[0] and first.token_ids == PROMPTS[0][: 4 * BS]
        assert first.parent_block_hash is None and first.block_size == BS
        assert all(h in stored for hs in hashes for h in hs)  # every prompt block announced
        assert set(hashes[0]) <= set(removed)  # the first prompt's blocks were evicted
        held = sub.holdings(hashes[0])
        assert held["e"]["dram"] == 4 and "device" not in held["e"]
        assert sub.holdings(hashes[-1])["e"]["device"] == 4
    finally:
        sub.close()


def test_kv_info_names_the_seed_and_the_sockets(llm):
    info = llm.engine.kv_info()
    assert info["block_size"] == BS and len(bytes.fromhex(info["hash_seed"])) == 32
    assert info["store_tiers"] == ["dram"]
    ev = info["kv_events"]
    assert ev["endpoint"].startswith("tcp://127.0.0.1:") and ev["curve"] is False
    port = int(ev["endpoint"].rsplit(":", 1)[1])
    assert ev["replay_endpoint"] != ev["endpoint"] and port > 0
