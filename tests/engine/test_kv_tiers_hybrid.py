"""KV tiers for a linear-attention model: a prefix is found again only with the state checkpoint
at its end, which travels through the store beside the blocks (kv/state_tiers.py).

A prefix loaded from the DRAM tier, the SSD tier or a shared pool (by another engine) gives what
computing it gives (fp32, placement device); a checkpoint the store lost makes the prefix
recomputed, never resumed from a wrong state; every step keeps every invariant.
"""

import pytest

from hetserve import LLM
from hetserve.kv.state_tiers import state_key
from tests.engine.test_kv_tiers import EXACT, PARAMS, computed, force_loads, generate

A = list(range(10, 110))  # 100 tokens: 6 full blocks of 16, a checkpoint every 2 blocks
B = list(range(120, 220))
C = list(range(230, 330))
TOL = 1e-4  # resuming at a checkpoint splits the delta rule's chunks differently


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("qwen3-next", lm_head_scale=4.0)


@pytest.fixture(scope="module")
def reference(model):
    llm = LLM(model, max_model_len=256, enable_prefix_caching=False, **EXACT)
    return llm.generate(prompt_token_ids=A, sampling_params=PARAMS)[0]


def engine(model, spec: str) -> LLM:
    return LLM(
        model, max_model_len=256, num_kv_blocks=40, kv_store=spec, state_checkpoint_every=2,
        **EXACT,
    )  # fmt: skip


def assert_close(out, ref) -> None:
    assert out.error is None and out.token_ids == ref.token_ids
    for mine, theirs, t in zip(out.logprobs, ref.logprobs, ref.token_ids, strict=True):
        assert mine[t].logprob == pytest.approx(theirs[t].logprob, abs=TOL)


def warm_then_dropped(llm: LLM) -> None:
    generate(llm, A, "warm")
    assert llm.engine.tiers.flush()
    llm.reset_prefix_cache()  # blocks and state checkpoints leave the device
    states = llm.engine.kv.states
    assert all(b.block_hash is None for b in states.pool.blocks[1:])


def test_prefix_and_its_checkpoint_come_back_from_dram(model, reference):
    llm = engine(model, "local://?dram=64M")
    try:
        warm_then_dropped(llm)
        before = computed(llm)
        out = generate(llm, A)
        assert out.num_cached_tokens == 96 and out.cached_tokens_by_tier == {"dram": 96}
        assert computed(llm) - before == len(A) - 96
        assert llm.engine.tiers.states.loaded == 1
        assert_close(out, reference)
    finally:
        llm.close()


def test_prefix_from_ssd_after_dram_eviction(model, reference, tmp_path):
    probe = engine(model, "local://?dram=1M")
    tiers = probe.engine.tiers
    one_prompt = 6 * tiers.saver.io.bytes_per_block + 3 * tiers.states.io.slot_bytes
    probe.close()
    llm = engine(model, f"local://?dram={one_prompt}&ssd_dir={tmp_path}&ssd=64M")
    try:
        force_loads(llm)
        for i, p in enumerate((A, B, C)):  # A's blocks and checkpoints go down to the SSD
            generate(llm, p, f"warm{i}")
            assert llm.engine.tiers.flush()
        llm.reset_prefix_cache()
        out = generate(llm, A)
        assert out.num_cached_tokens == 96, out.cached_tokens_by_tier
        assert out.cached_tokens_by_tier.get("ssd", 0) > 0, out.cached_tokens_by_tier
        assert llm.engine.tiers.states.loaded == 1
        assert_close(out, reference)
    finally:
        llm.close()


def test_another_engine_resumes_a_prefix_from_the_pool(model, reference, request):
    from tests.store.servers import PoolCluster

    cluster = PoolCluster(request, 1, "96M")
    writer = engine(model, cluster.spec)
    try:
        generate(writer, A, "w")  # a shared store: prompt blocks and checkpoints written through
        assert writer.engine.tiers.flush()
    finally:
        writer.close()
    reader = engine(model, cluster.spec)
    try:
        force_loads(reader)
        out = generate(reader, A)
        assert out.num_cached_tokens == 96, out.cached_tokens_by_tier
        assert set(out.cached_tokens_by_tier) <= {"pool", "pool-shm"}
        assert reader.engine.tiers.states.loaded == 1
        assert_close(out, reference)
    finally:
        reader.close()


def test_a_lost_checkpoint_means_recompute_not_a_wrong_state(model, reference):
    llm = engine(model, "local://?dram=64M")
    try:
        warm_then_dropped(llm)
        states = llm.engine.tiers.states
        for h in states.saved_hashes():
            llm.engine.tiers.store.remove(state_key(h))
        states._known.clear()  # what this engine believes it saved is gone from the store
        out = generate(llm, A)
        assert out.num_cached_tokens == 0 and states.loaded == 0
        assert_close(out, reference)
    finally:
        llm.close()
