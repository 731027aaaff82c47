"""The C decode-attention kernel against the torch gather-then-SDPA path it replaces."""

from __future__ import annotations

import pytest
import torch

from hetserve.kv.paged import PagedKVCache
from hetserve.layers.attention import batched_decode_sdpa, build_metadata
from hetserve.layers.native_decode import native_decode_attention
from hetserve.native import native_unavailable_reason

pytestmark = pytest.mark.skipif(
    native_unavailable_reason() is not None,
    reason=f"native kernels unavailable: {native_unavailable_reason()}",
)
BS = 16


def _setup(b, hkv, g, d, dv, window, seed=0, max_len=150, num_blocks=200, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    kv = PagedKVCache([[(hkv, d), (hkv, dv)]], num_blocks, BS, dtype, "cpu")
    slots = torch.arange(num_blocks * BS)
    kv.write(0, slots, *(torch.randn(t.shape, generator=gen) for t in kv.layers[0]))
    lens = torch.randint(1, max_len, (b,), generator=gen).tolist()
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 is the null one
    spans = []
    for n in lens:
        blocks, free = free[: -(-n // BS)], free[-(-n // BS) :]
        spans.append((n - 1, 1, blocks))
    spans.append((0, 3, [free[0]]))  # one prefill chunk too: decodes are batched beside it
    meta = build_metadata(spans, BS, "cpu", window)
    q = torch.randn(b, hkv * g, d, generator=gen)
    return kv, meta.decode, q


def _reference(kv, d, q, scale):
    b, n = d.slots.shape
    k, v = kv.gather(0, d.slots.flatten(), torch.float32)  # an fp16 cache's exact values
    return batched_decode_sdpa(
        q, k.view(b, n, *k.shape[1:]), v.view(b, n, *v.shape[1:]), d.mask, scale
    )


@pytest.mark.parametrize(
    "b,hkv,g,d,dv,window",
    [
        (9, 4, 2, 32, 32, None),  # GQA, many sequences: one work item per sequence
        (2, 2, 4, 64, 64, None),  # few sequences: items split by KV head
        (5, 1, 3, 20, 12, 9),  # head dims not multiples of 8, a sliding window, MQA
        (3, 4, 1, 128, 128, 40),  # MHA, window wider than some contexts
        (1, 8, 1, 8, 8, None),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_matches_gather_then_sdpa(b, hkv, g, d, dv, window, dtype):
    kv, dec, q = _setup(b, hkv, g, d, dv, window, dtype=dtype)
    scale = d**-0.5
    ref = _reference(kv, dec, q, scale)  # int8: over the dequantized rows
    out = native_decode_attention(q, *kv.layers[0], dec, kv, scale, window, None, kv.scales[0])
    assert out.shape == ref.shape
    assert (out - ref).abs().max() < 1e-5


def test_threads_give_identical_results():
    kv, dec, q = _setup(12, 4, 2, 32, 32, None, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_decode_attention(q, *kv.layers[0], dec, kv, 0.2, None)
        torch.set_num_threads(2)
        two = native_decode_attention(q, *kv.layers[0], dec, kv, 0.2, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_block_outside_the_cache_is_an_error_not_a_read():
    kv, dec, q = _setup(3, 2, 2, 32, 32, None, seed=4)
    dec.tables[1, 0] = kv.num_blocks + 5
    with pytest.raises(RuntimeError, match="code -2"):
        native_decode_attention(q, *kv.layers[0], dec, kv, 0.2, None)


def test_engine_outputs_equal_with_and_without_native_kernels(tiny_model, monkeypatch):
    from hetserve import LLM, SamplingParams

    path = tiny_model("qwen3-moe")
    prompts = [[5 + i, 17, 42 + i, 9] * (3 + 5 * i) for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    llm = LLM(path, placement="device")
    assert all(e.backend_name == "cpu-fp32" for _, e in llm.model.routed_experts())
    native = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", "0")
    llm = LLM(path, placement="device")
    assert all(e.backend_name == "torch" for _, e in llm.model.routed_experts())
    plain = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for a, b in zip(native, plain, strict=True):
        assert a.token_ids == b.token_ids
        lp_a = [next(iter(x.values())).logprob for x in a.logprobs]
        lp_b = [next(iter(x.values())).logprob for x in b.logprobs]
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b, strict=True)) < 1e-4


def test_nan_in_a_query_stays_in_its_row_like_sdpa():
    kv, dec, q = _setup(4, 2, 2, 32, 32, None, seed=5)
    q[1, 0, 3] = float("nan")
    ref = _reference(kv, dec, q, 0.2)
    out = native_decode_attention(q, *kv.layers[0], dec, kv, 0.2, None)
    assert torch.isnan(out[1, 0]).all() and torch.isnan(ref[1, 0]).all()
    keep = torch.ones(out.shape[:2], dtype=torch.bool)
    keep[1, 0] = False
    assert (out[keep] - ref[keep]).abs().max() < 1e-5


def _float64_reference(kv, d, q, scale, window, sinks):
    """Per sequence in float64 over the cache's exact values (an 8-bit cache dequantized), with
    gpt-oss's sink logit in each head's denominator."""
    out = torch.zeros(q.shape[0], q.shape[1], kv.layers[0][1].shape[-1], dtype=torch.float64)
    for b in range(q.shape[0]):
        n = int(d.lens[b])
        lo = max(0, n - window) if window else 0
        pos = torch.arange(lo, n)
        slots = d.tables[b, pos // BS] * BS + pos % BS
        k, v = (t.double() for t in kv.gather(0, slots, torch.float32))
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # [n, H, D]
        s = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale
        m = s.amax(1, keepdim=True)
        if sinks is not None:
            m = torch.maximum(m, sinks.double().view(-1, 1))
        e = (s - m).exp()
        den = e.sum(1) + ((sinks.double() - m[:, 0]).exp() if sinks is not None else 0)
        out[b] = torch.einsum("hn,nhd->hd", e, v) / den.view(-1, 1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("window,with_sinks", [(None, False), (None, True), (300, True)])
@pytest.mark.parametrize("g", [3, 4, 2])
def test_contexts_of_many_chunks_match_and_each_sequence_is_the_same_bits_alone(
    dtype, window, with_sinks, g
):
    """Contexts from 1 to 700 tokens: the kernel splits each into 128-token chunks and merges
    them, so chunk edges (127, 128, 129), several chunks and a window starting inside a chunk all
    meet the float64 reference; a sequence decoded alone (its few chunks then split by KV head
    over the threads), or on one thread, gives the same bits as in the batch. G = 3, 4 and 2
    take the three score blocks (1 head x 8 tokens, 4 x 2, 2 x 4)."""
    gen = torch.Generator().manual_seed(7)
    hkv, dim = 2, 40  # D, Dv not multiples of 16
    lens = [1, 127, 128, 129, 300, 700, 17]
    num_blocks = sum(-(-n // BS) for n in lens) + 3
    kv = PagedKVCache([[(hkv, dim), (hkv, dim)]], num_blocks, BS, dtype, "cpu")
    kv.write(
        0,
        torch.arange(num_blocks * BS),
        *(torch.randn(t.shape, generator=gen) for t in kv.layers[0]),
    )
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    spans = []
    for n in lens:
        blocks, free = free[: -(-n // BS)], free[-(-n // BS) :]
        spans.append((n - 1, 1, blocks))
    dec = build_metadata(spans, BS, "cpu", window).decode
    q = torch.randn(len(lens), hkv * g, dim, generator=gen) * 2
    sinks = torch.randn(hkv * g, generator=gen) * 3 if with_sinks else None
    scale = dim**-0.5
    out = native_decode_attention(q, *kv.layers[0], dec, kv, scale, window, sinks, kv.scales[0])
    ref = _float64_reference(kv, dec, q, scale, window, sinks)
    assert (out.double() - ref).abs().max() < 2e-5
    for b, n in enumerate(lens):
        alone = build_metadata([spans[b]], BS, "cpu", window).decode
        one = native_decode_attention(
            q[b : b + 1], *kv.layers[0], alone, kv, scale, window, sinks, kv.scales[0]
        )
        assert torch.equal(one[0], out[b]), f"sequence {b} ({n} tokens) differs alone"
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = native_decode_attention(
            q, *kv.layers[0], dec, kv, scale, window, sinks, kv.scales[0]
        )
    finally:
        torch.set_num_threads(before)
    assert torch.equal(serial, out)
