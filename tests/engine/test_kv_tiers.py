"""KV tiers behind the prefix cache: blocks saved to a store and loaded back into the device pool.

Every load must give what recomputing gives (fp32 logprobs to 1e-5) and leave only the uncached
tail to prefill; every failure (a corrupt block, a block that vanished, a store that raises or
hangs, a request aborted mid-load) must be a miss that recomputes, with the request completing
and every block accounted for (`check_integrity` after every step).
"""

import threading
import time

import pytest

from hetserve import LLM, SamplingParams
from hetserve.core.block_hash import hash_prefix_blocks
from hetserve.core.request import NewRequest

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
A = list(range(10, 110))  # 100 tokens: 6 full blocks of 16 can be cached
B = list(range(120, 220))
C = list(range(230, 330))


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3-moe", lm_head_scale=4.0)


# fp32 everywhere (placement "device"): a prefix loaded from a tier must give the logprobs of
# computing it, which int8 activations' rounding would blur across chunk shapes.
EXACT = {"placement": "device"}


@pytest.fixture(scope="module")
def reference(model):
    llm = LLM(model, max_model_len=256, **EXACT)
    return {
        name: llm.generate(prompt_token_ids=p, sampling_params=PARAMS)[0]
        for name, p in (("A", A), ("B", B), ("C", C))
    }


def engine(model, spec: str, **options) -> LLM:
    return LLM(model, max_model_len=256, num_kv_blocks=40, kv_store=spec, **{**EXACT, **options})


def generate(llm: LLM, prompt: list[int], rid: str = "r"):
    """One request, stepped by hand with the invariants checked after every step."""
    llm.engine.submit(NewRequest(rid, prompt, PARAMS))
    outs = []
    for _ in range(10_000):
        if not llm.engine.has_unfinished():
            break
        outs += llm.engine.step()
        llm.engine.check_integrity()
        time.sleep(0.0005)  # let the tier threads run between steps
    return outs[-1]


def assert_same(out, ref) -> None:
    assert out.error is None and out.token_ids == ref.token_ids
    for mine, theirs, t in zip(out.logprobs, ref.logprobs, ref.token_ids, strict=True):
        assert mine[t].logprob == pytest.approx(theirs[t].logprob, abs=1e-5)


def computed(llm: LLM) -> int:
    return llm.stats().prompt_tokens_computed


def force_loads(llm: LLM) -> None:
    """Make every load look worth it (a very slow prefill), whatever this machine measures."""
    cost = llm.engine.tiers.cost
    cost.prefill_tokens_per_s = 1.0
    cost.observe_prefill = lambda *a: None


def load_off_thread(llm: LLM) -> None:
    """Load from the DRAM tier on the loader thread, as from a remote or SSD tier (an
    in-process DRAM tier is otherwise copied at admission, where nothing can hang)."""
    llm.engine.tiers.loads.inline = {"staged"}


def saved_then_dropped(llm: LLM, *prompts) -> None:
    """Compute the prompts, save their blocks, then drop the device prefix cache."""
    for i, p in enumerate(prompts):
        generate(llm, p, f"warm{i}")
        assert llm.engine.tiers.flush()
    llm.reset_prefix_cache()


def test_warm_from_dram_loads_the_prefix_and_prefills_only_the_tail(model, reference):
    llm = engine(model, "local://?dram=64M")
    try:
        assert "dram" in llm.engine.kv_summary
        saved_then_dropped(llm, A)
        before = computed(llm)
        out = generate(llm, A)
        assert out.num_cached_tokens == 96 and out.cached_tokens_by_tier == {"dram": 96}
        assert computed(llm) - before == len(A) - 96
        assert_same(out, reference["A"])
        tiers = llm.stats().tiers
        assert tiers.loaded_blocks == {"dram": 6} and tiers.load_bytes > 0
    finally:
        llm.close()


def test_hit_from_ssd_after_dram_eviction(model, reference, tmp_path):
    probe = engine(model, "local://?dram=1M")
    per_block = probe.engine.tiers.saver.io.bytes_per_block
    probe.close()
    dram = 8 * per_block  # room for one prompt's blocks, not three
    llm = engine(model, f"local://?dram={dram}&ssd_dir={tmp_path}&ssd=16M")
    try:
        force_loads(llm)
        saved_then_dropped(llm, A, B, C)  # A's blocks went down to the SSD
        store = llm.engine.tiers.store
        out = generate(llm, A)
        assert out.cached_tokens_by_tier.get("ssd", 0) > 0, out.cached_tokens_by_tier
        assert_same(out, reference["A"])
        assert {t.name for t in store.tiers()} == {"dram", "ssd"}
    finally:
        llm.close()


def test_recompute_when_it_is_predicted_faster(model, reference):
    llm = engine(model, "local://?dram=64M")
    try:
        saved_then_dropped(llm, A)
        cost = llm.engine.tiers.cost
        cost.prefill_tokens_per_s = 1e15  # recomputing is free: no load can beat it
        cost.observe_prefill = lambda *a: None
        before = computed(llm)
        out = generate(llm, A)
        assert out.num_cached_tokens == 0 and computed(llm) - before == len(A)
        assert llm.stats().tiers.skipped_blocks == 6
        assert_same(out, reference["A"])
    finally:
        llm.close()


def test_a_lone_request_loads_a_fast_tier_after_a_history_of_long_prefills(model, reference):
    llm = engine(model, "local://?dram=64M")
    try:
        load_off_thread(llm)  # read on the loader thread, as a pool or SSD tier is
        saved_then_dropped(llm, A)
        cost = llm.engine.tiers.cost
        for _ in range(20):  # 2048-token prefills of 2 s each, as the engine observes steps
            cost.observe_step(2.0, 2048)
        before = computed(llm)
        out = generate(llm, A)  # nothing else runs: the load waits only for its read
        assert out.cached_tokens_by_tier == {"dram": 96}
        assert computed(llm) - before == len(A) - 96
        assert_same(out, reference["A"])
        tiers = llm.stats().tiers
        assert tiers.skipped_blocks == 0
        fit = tiers.load_fit["dram"]
        assert fit.loads == 1 and fit.measured_s > 0 and fit.measured_wait_s > 0
        # Predicted: the read, rounded up to the engine's poll while only the load is out.
        assert fit.predicted_s > 0 and fit.predicted_wait_s >= fit.predicted_s
        assert fit.predicted_wait_s <= fit.predicted_s + llm.engine.tiers.poll_s
    finally:
        llm.close()


def test_a_load_planned_while_others_decode_waits_through_their_steps(model):
    llm = engine(model, "local://?dram=64M")
    try:
        tiers = llm.engine.tiers
        seen = []
        prepare = tiers.prepare

        def spy(req, computed_blocks):
            seen.append((req.request_id, tiers.loads.period_s, tiers.cost.decode_step_s))
            return prepare(req, computed_blocks)

        tiers.prepare = spy
        llm.engine.submit(NewRequest("first", B, PARAMS))
        for _ in range(3):  # its prefill, then decode steps
            llm.engine.step()
        llm.engine.submit(NewRequest("second", A, PARAMS))
        llm.engine.step()
        assert seen[0] == ("first", tiers.poll_s, None)  # nothing ran: the engine polls
        rid, period, decode = seen[-1]
        assert rid == "second" and decode is not None
        assert period == max(decode, tiers.poll_s)  # the decode step, not the prefill before
        while llm.engine.has_unfinished():
            llm.engine.step()
            llm.engine.check_integrity()
    finally:
        llm.close()


def _wrap_reads(llm: LLM, before_read) -> None:
    store = llm.engine.tiers.store
    read = store.batch_get_into_parts

    def wrapped(keys, parts):
        before_read(store, keys)
        return read(keys, parts)

    store.batch_get_into_parts = wrapped


def _corrupt_third(store, keys) -> None:
    entry = store._dram[bytes(keys[2]).hex()]  # the local store's DRAM arena
    store._arena[entry.offset + entry.size // 2] ^= 0xFF


def _remove_third(store, keys) -> None:
    assert store.remove(keys[2])


def _fail(store, keys) -> None:
    raise ConnectionError("injected store failure")


@pytest.mark.parametrize(
    "damage,loaded",
    [(_corrupt_third, 32), (_remove_third, 32), (_fail, 0)],
    ids=["checksum", "vanished", "store-raises"],
)
def test_a_block_that_fails_is_recomputed_with_those_after_it(model, reference, damage, loaded):
    llm = engine(model, "local://?dram=64M")
    try:
        force_loads(llm)
        saved_then_dropped(llm, A)
        _wrap_reads(llm, damage)
        before = computed(llm)
        out = generate(llm, A)
        assert out.cached_tokens_by_tier.get("dram", 0) == loaded
        assert computed(llm) - before == len(A) - loaded
        tiers = llm.stats().tiers
        assert tiers.missed_blocks == 6 - loaded // 16
        assert tiers.load_fit == {}  # a read cut short says nothing about the model
        assert_same(out, reference["A"])
    finally:
        llm.close()


def test_a_hanging_store_times_out_and_its_blocks_come_back(model, reference):
    llm = engine(model, "local://?dram=64M")
    release = threading.Event()
    try:
        force_loads(llm)
        load_off_thread(llm)
        saved_then_dropped(llm, A)
        llm.engine.tiers.loads.load_timeout_s = 0.2
        _wrap_reads(llm, lambda store, keys: release.wait(10))
        out = generate(llm, A)  # the load is abandoned: the request recomputes
        assert out.num_cached_tokens == 0
        assert_same(out, reference["A"])
        assert llm.engine.tiers.blocks.pinned  # the abandoned load's blocks are still held...
        release.set()
        deadline = time.monotonic() + 10
        while llm.engine.tiers.blocks.pinned and time.monotonic() < deadline:
            llm.engine.step()
            time.sleep(0.01)
        assert not llm.engine.tiers.blocks.pinned  # ...until the worker let go of them
        llm.engine.check_integrity()
    finally:
        release.set()
        llm.close()


def test_abort_while_loading_frees_the_blocks_when_the_load_lands(model):
    llm = engine(model, "local://?dram=64M")
    gate = threading.Event()
    try:
        force_loads(llm)
        load_off_thread(llm)
        saved_then_dropped(llm, A)
        _wrap_reads(llm, lambda store, keys: gate.wait(10))
        llm.engine.submit(NewRequest("gone", A, PARAMS))
        for _ in range(50):
            llm.engine.step()
            if llm.engine.scheduler.loading:
                break
        assert "gone" in llm.engine.scheduler.loading
        assert llm.engine.abort_request("gone")
        llm.engine.check_integrity()
        gate.set()
        deadline = time.monotonic() + 10
        while llm.engine.has_unfinished() and time.monotonic() < deadline:
            llm.engine.step()
            llm.engine.check_integrity()
        stats = llm.stats()
        assert stats.kv_blocks_used == 0 and not llm.engine.scheduler.loading
    finally:
        gate.set()
        llm.close()


def test_a_store_that_fails_its_startup_check_is_one_line(model):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = f"pool://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "hetserve.cli", "generate", "--model", str(model)]
    r = subprocess.run(
        [*cmd, "--kv-store", spec, "hi"], capture_output=True, text=True, timeout=180
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], r.stderr


def test_a_sessions_blocks_stay_in_the_dram_tier_while_it_is_live(model):
    probe = engine(model, "local://?dram=1M")
    per_block = probe.engine.tiers.saver.io.bytes_per_block
    probe.close()
    llm = engine(model, f"local://?dram={10 * per_block}", session_ttl=600)
    try:
        llm.engine.submit(NewRequest("s", A, PARAMS, session_id="agent"))
        while llm.engine.has_unfinished():
            llm.engine.step()
        assert llm.engine.tiers.flush()
        for i, p in enumerate((B, C)):  # others' blocks overflow the DRAM tier twice over
            generate(llm, p, f"o{i}")
            assert llm.engine.tiers.flush()
        store, seed = llm.engine.tiers.store, llm.engine.kv.hash_seed
        session = [h.digest for h in hash_prefix_blocks(A, 16, seed=seed)][:6]
        other = [h.digest for h in hash_prefix_blocks(B, 16, seed=seed)][:1]
        assert store.batch_locate(session) == ["dram"] * 6  # soft-pinned for the session's TTL
        assert store.batch_locate(other) == [None]  # not pinned: evicted (no SSD tier here)
    finally:
        llm.close()


def test_blocks_evicted_a_moment_ago_come_back_from_the_victim_cache(model, reference):
    # 12 device blocks: B's prefill evicts A's cached blocks, which are staged on the way out.
    llm = LLM(model, max_model_len=128, num_kv_blocks=12, kv_store="local://?dram=64M", **EXACT)
    try:
        force_loads(llm)
        generate(llm, A, "a")
        generate(llm, B, "b")
        before = computed(llm)
        out = generate(llm, A, "a2")
        assert out.cached_tokens_by_tier.get("staged", 0) > 0, out.cached_tokens_by_tier
        assert computed(llm) - before == len(A) - out.num_cached_tokens
        assert_same(out, reference["A"])
    finally:
        llm.close()


def test_staging_copies_are_the_same_bytes_on_the_native_and_torch_paths(monkeypatch):
    import torch

    from hetserve.engine.kv_store import BlockIO
    from hetserve.kv.paged import PagedKVCache
    from hetserve.native import native_unavailable_reason

    if native_unavailable_reason():
        pytest.skip(f"native kernels: {native_unavailable_reason()}")
    cache = PagedKVCache([[(2, 8), (2, 8)]] * 3, 20, 4, torch.float32, "cpu")
    for layer in cache.layers:
        for t in layer:
            t.copy_(torch.randn_like(t))
    before = [t.clone() for layer in cache.layers for t in layer]
    io = BlockIO(cache)
    ids, slots = [3, 7, 1, 19], [10, 2, io.staging_slots - 1, 11]
    staged = {}
    for native in ("1", "0"):
        monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", native)
        io._staging.zero_()
        io.stage(ids, slots)
        staged[native] = io._staging.clone()
    assert torch.equal(staged["0"], staged["1"])
    for src, slot in zip(ids, slots, strict=True):  # a stored object's layout: parts in order
        parts = [t[src * 4 : src * 4 + 4].reshape(-1).view(torch.uint8) for t in before]
        assert torch.equal(staged["1"][slot], torch.cat(parts))
    for native in ("1", "0"):
        monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", native)
        for layer in cache.layers:
            for t in layer:
                t.zero_()
        io.unstage(slots, [0, 5, 6, 12])
        tensors = [t for layer in cache.layers for t in layer]
        for old, new in zip(before, tensors, strict=True):
            for src, dst in zip(ids, [0, 5, 6, 12], strict=True):
                assert torch.equal(new[dst * 4 : dst * 4 + 4], old[src * 4 : src * 4 + 4])
            assert not new[4:8].any()  # block 1 was not a destination
