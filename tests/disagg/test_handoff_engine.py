"""Prefill on one engine, decode on another, the KV handed over: the same tokens and logprobs
as one engine doing both (greedy; fp32), for GQA (Qwen3-MoE), MLA (DeepSeek) and a hybrid
linear-attention model (Qwen3-Next: its state after the handed tokens goes with the blocks),
through each hand-off path; and a hand-off that never comes is recomputed."""

import dataclasses

import pytest

from hetserve import SamplingParams
from hetserve.config import EngineConfig
from hetserve.core.request import HandoffPath, HandoffRole, KVHandoff, NewRequest
from hetserve.engine.core import EngineCore
from hetserve.kv import handoff_direct, handoff_paths

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
PROMPT = list(range(5, 5 + 45))  # 2 full blocks of 16 and a partial one for the 44 handed over


def config(model, **options):
    return EngineConfig.from_options(
        model=str(model), max_model_len=128, dtype="float32", **options
    )


def run(engine: EngineCore, new: NewRequest):
    engine.submit(new)
    last = None
    while engine.has_unfinished() or engine.background_work():
        for out in engine.step():
            last = out
        engine.check_integrity()
    return last


def disaggregated(prefill, decode, prompt, key, path=HandoffPath.DIRECT, timeout_s=30.0):
    recv = KVHandoff(key, HandoffRole.RECEIVE, path, timeout_s=timeout_s)
    send = KVHandoff(key, HandoffRole.SEND, path, peer=decode.handoff.address)
    decode.submit(NewRequest(f"d-{key}", prompt, PARAMS, kv_handoff=recv))
    first = run(prefill, NewRequest(f"p-{key}", prompt, dataclasses.replace(PARAMS, max_tokens=1),
                                    kv_handoff=send))  # fmt: skip
    out = None
    while decode.has_unfinished():
        for o in decode.step():
            out = o
        decode.check_integrity()
    return first, out


def same(a, b):
    assert a.token_ids == b.token_ids
    for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
        for tok, lp in la.items():
            assert lp.logprob == pytest.approx(lb[tok].logprob, abs=1e-5)


@pytest.fixture(scope="module", params=["qwen3-moe", "deepseek-v3", "qwen3-next"])
def engines(request, tiny_model):
    model = tiny_model(request.param)
    colocated = EngineCore(config(model))
    prefill = EngineCore(config(model, role="prefill"))
    decode = EngineCore(config(model, role="decode"))
    yield colocated, prefill, decode
    for e in (colocated, prefill, decode):
        e.close()


def test_direct_handoff_on_one_host_equals_colocated(engines):
    colocated, prefill, decode = engines
    want = run(colocated, NewRequest("c", PROMPT, PARAMS))
    sent = prefill.stats().handoff.sent_bytes.get("direct", 0)
    first, got = disaggregated(prefill, decode, PROMPT, "shm1")
    same(got, want)
    assert first.token_ids == want.token_ids[:1]  # the prefill's own first token agrees
    assert got.num_cached_tokens == len(PROMPT) - 1  # everything but the last token came over
    stats = decode.stats().handoff
    assert stats.received >= 1 and stats.receive_failed == 0
    assert prefill.stats().handoff.sent["direct"] >= 1
    assert prefill.kv.pool.num_free == prefill.kv.pool.num_usable  # the sender let go
    # 3 blocks (44 tokens) and, for a linear-attention model, its state after them
    sender = prefill.handoff.sender
    state = 0 if sender.state_io is None else sender.state_io.slot_bytes
    assert (
        prefill.stats().handoff.sent_bytes["direct"] - sent == 3 * sender.io.bytes_per_block + state
    )
    if prefill.kv.states is not None:  # the state's slots came back on both sides
        assert state > 0 and not prefill.kv.states.shipping and not prefill.kv.states.handoffs
        assert not decode.kv.states.loads


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3"])
def test_an_int8_kv_cache_hands_off_its_scales_with_its_rows(tiny_model, family):
    """--kv-cache-dtype int8: a block's scales are parts of it, so the decode engine attends
    over the prefill's int8 rows with their scales, as one int8 engine doing both would."""
    model = tiny_model(family)
    made = [
        EngineCore(config(model, kv_cache_dtype="int8", **role))
        for role in ({}, {"role": "prefill"}, {"role": "decode"})
    ]
    colocated, prefill, decode = made
    try:
        assert decode.runner.kv.quantized
        want = run(colocated, NewRequest("c", PROMPT, PARAMS))
        _, got = disaggregated(prefill, decode, PROMPT, f"int8-{family}")
        same(got, want)
        assert got.num_cached_tokens == len(PROMPT) - 1
    finally:
        for e in made:
            e.close()


def test_direct_handoff_over_tcp_equals_colocated(engines, monkeypatch):
    colocated, prefill, decode = engines
    want = run(colocated, NewRequest("c", PROMPT, PARAMS))
    # Another "host": the receiver offers no shared memory, the blocks go over TCP stripes.
    monkeypatch.setattr(handoff_direct, "STRIPE_BYTES", decode.handoff.receiver.io.bytes_per_block)
    calls = []
    real = handoff_direct._push_all
    monkeypatch.setattr(handoff_direct, "_push_all", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(prefill.handoff.sender.direct, "share_memory", False)
    _, got = disaggregated(prefill, decode, PROMPT, "tcp1")
    same(got, want)
    assert calls  # it did go over TCP


def test_a_handoff_that_never_comes_is_recomputed(engines):
    colocated, _, decode = engines
    want = run(colocated, NewRequest("c", PROMPT, PARAMS))
    recv = KVHandoff("never", HandoffRole.RECEIVE, HandoffPath.DIRECT, timeout_s=0.05)
    got = run(decode, NewRequest("lonely", PROMPT, PARAMS, kv_handoff=recv))
    same(got, want)
    assert decode.stats().handoff.receive_failed >= 1


def test_roles_refuse_the_other_side(engines):
    _, prefill, decode = engines
    from hetserve.errors import InvalidInputError

    recv = KVHandoff("x", HandoffRole.RECEIVE)
    with pytest.raises(InvalidInputError, match="does not receive"):
        prefill.validate(NewRequest("x", PROMPT, PARAMS, kv_handoff=recv))
    send = KVHandoff("x", HandoffRole.SEND, peer="127.0.0.1:1")
    with pytest.raises(InvalidInputError, match="does not send"):
        decode.validate(NewRequest("x", PROMPT, PARAMS, kv_handoff=send))


@pytest.fixture(scope="module")
def pool_spec(request):
    from tests.store.servers import PoolCluster

    return PoolCluster(request, 1, "64M").spec


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3", "qwen3-next"])
def test_store_handoff_equals_colocated_and_leaves_no_request_keys(tiny_model, pool_spec, family):
    model = tiny_model(family)
    colocated = EngineCore(config(model))
    store = dict(kv_store=pool_spec, kv_save="write-back")
    prefill = EngineCore(config(model, role="prefill", **store))
    decode = EngineCore(config(model, role="decode", **store))
    try:
        want = run(colocated, NewRequest("c", PROMPT, PARAMS))
        _, got = disaggregated(prefill, decode, PROMPT, f"st-{family}", HandoffPath.STORE)
        same(got, want)
        assert got.num_cached_tokens == len(PROMPT) - 1
        assert prefill.stats().handoff.sent.get("store") == 1
        assert decode.stats().handoff.received == 1
        # The partial block and the manifest were request-scoped: gone once read.
        key = f"st-{family}"
        keys = [handoff_paths._tail_key(key), handoff_paths._manifest_key(key)]
        keys.append(handoff_paths._state_key(key))
        assert not any(decode.tiers.store.exists(k) for k in keys)
    finally:
        for e in (colocated, prefill, decode):
            e.close()


def test_a_link_failing_mid_way_is_finished_over_the_others(engines, monkeypatch):
    colocated, prefill, decode = engines
    want = run(colocated, NewRequest("c", PROMPT, PARAMS))
    monkeypatch.setattr(handoff_direct, "STRIPE_BYTES", decode.handoff.receiver.io.bytes_per_block)
    monkeypatch.setattr(prefill.handoff.sender.direct, "share_memory", False)
    failed = []
    real = handoff_direct._push_all

    def flaky(client, key, stripes, blocks):
        if not failed and len(stripes) > 0:  # the first link dies after one stripe
            failed.append(client)
            real(client, key, stripes[:1], blocks)
            client.close()
            return stripes[1:]
        return real(client, key, stripes, blocks)

    monkeypatch.setattr(handoff_direct, "_push_all", flaky)
    _, got = disaggregated(prefill, decode, PROMPT, "flaky1")
    same(got, want)
    assert failed and got.num_cached_tokens == len(PROMPT) - 1


@pytest.mark.parametrize("family", ["qwen3-moe", "qwen3-next"])
def test_mooncake_transfer_engine_handoff_equals_colocated(tiny_model, monkeypatch, family):
    """qwen3-next: the linear-attention state rides after the blocks through the engine too."""
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not installed")
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    from hetserve.kv import handoff_mooncake

    registered = []
    real = handoff_mooncake.register
    monkeypatch.setattr(
        handoff_mooncake, "register", lambda te, a, n: (registered.append((a, n)), real(te, a, n))
    )
    model = tiny_model(family)
    colocated = EngineCore(config(model))
    prefill = EngineCore(config(model, role="prefill", handoff_mooncake=True))
    decode = EngineCore(config(model, role="decode", handoff_mooncake=True))
    try:
        want = run(colocated, NewRequest("c", PROMPT, PARAMS))
        _, got = disaggregated(prefill, decode, PROMPT, "te1", HandoffPath.MOONCAKE)
        same(got, want)
        assert got.num_cached_tokens == len(PROMPT) - 1
        assert prefill.stats().handoff.sent.get("mooncake") == 1
        if family == "qwen3-next":  # the state's snapshot was registered for the transfer
            assert registered[-1][1] == prefill.handoff.sender.state_io.slot_bytes
    finally:
        for e in (colocated, prefill, decode):
            e.close()


@pytest.mark.parametrize("family", ["qwen3-moe", "qwen3-next"])
def test_a_landing_into_evicted_blocks_lets_the_store_save_their_own_bytes(tiny_model, family):
    """A decode instance with a KV store: a hand-off landing into cached blocks it just evicted
    writes over them at once, so their write-back copies must be taken before (the store once
    kept the landed bytes under the evicted blocks' identities)."""
    model = tiny_model(family)
    prefill = EngineCore(config(model, role="prefill"))
    decode = EngineCore(
        config(model, role="decode", kv_store="local://?dram=64M", num_kv_blocks=9)
    )  # 8 usable blocks of 16 tokens: one 128-token sequence
    try:
        first = list(range(5, 105))  # 6 full blocks, then the landing's partial one
        disaggregated(prefill, decode, first, "evict-a")
        io = decode.tiers.saver.io
        cached = {
            b.block_hash.digest: b"".join(bytes(p) for p in io.save_parts([b.block_id])[0])
            for b in decode.kv.pool.blocks[1:]
            if b.block_hash is not None
        }
        assert cached
        other = [t + 100 for t in first]  # its landing evicts the first prompt's blocks
        disaggregated(prefill, decode, other, "evict-b")
        assert decode.tiers.flush()
        saved = {k: decode.tiers.store.get(k) for k in cached}
        assert any(v is not None for v in saved.values())  # evicted, so written back
        wrong = [k.hex()[:12] for k, v in saved.items() if v is not None and v != cached[k]]
        assert not wrong, f"the store keeps other bytes under {wrong}"
    finally:
        prefill.close()
        decode.close()
