"""The C prefill-attention kernel against a float64 reference of the same causal attention, and
the engine's prefill on it against one pass and against the gather + SDPA path."""

from __future__ import annotations

import pytest
import torch

from hetserve.kv.paged import PagedKVCache
from hetserve.layers.native_prefill import (
    bf16_products_ok,
    native_prefill_attention,
    native_prefill_ok,
)
from hetserve.native import native_unavailable_reason

pytestmark = pytest.mark.skipif(
    native_unavailable_reason() is not None,
    reason=f"native kernels unavailable: {native_unavailable_reason()}",
)


def _cache(kv_len, bs, hkv, d, dv, dtype, seed):
    """A cache holding one sequence's kv_len tokens in shuffled blocks; its context slots."""
    gen = torch.Generator().manual_seed(seed)
    nblocks = -(-kv_len // bs) + 3
    kv = PagedKVCache([[(hkv, d), (hkv, dv)]], nblocks + 1, bs, dtype, "cpu")
    slots = torch.arange((nblocks + 1) * bs)
    kv.write(0, slots, *(torch.randn(t.shape, generator=gen) for t in kv.layers[0]))
    blocks = torch.randperm(nblocks, generator=gen)[: -(-kv_len // bs)] + 1  # 0: the null block
    ctx = (blocks.unsqueeze(1) * bs + torch.arange(bs)).flatten()[:kv_len]
    return kv, ctx


def reference(q, k, v, start, scale, window, sinks):
    """float64 causal attention of q [T, H, D] at positions start.. over k, v [L, Hkv, *]."""
    t, h, _ = q.shape
    g = h // k.shape[1]
    k, v = (x.double().repeat_interleave(g, dim=1).transpose(0, 1) for x in (k, v))
    s = (q.double().transpose(0, 1) @ k.transpose(1, 2)) * scale  # [H, T, L]
    qpos = torch.arange(start, start + t).unsqueeze(1)
    kpos = torch.arange(k.shape[1]).unsqueeze(0)
    ok = kpos <= qpos
    if window is not None:
        ok &= qpos - kpos < window
    s = s.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        s = torch.cat((s, sinks.double().view(h, 1, 1).expand(h, t, 1)), dim=-1)
    p = s.softmax(-1)[..., : k.shape[1]]
    return (p @ v).transpose(0, 1)


CASES = [
    # T, start, block size, H, Hkv, D, Dv, window
    (37, 0, 16, 8, 2, 32, 32, None),  # a whole prompt, GQA 4
    (50, 29, 16, 4, 4, 64, 64, None),  # a later chunk starting mid-block, MHA
    (130, 77, 32, 6, 2, 20, 12, None),  # head dims off the 8/16 grid, keys past one tile
    (45, 100, 16, 8, 1, 16, 16, 24),  # MQA, a sliding window narrower than the chunk
    (70, 5, 8, 16, 2, 128, 128, 200),  # G 8 (query tiles of 6 tokens), window wider than all
    (1, 63, 16, 4, 2, 32, 32, None),  # a one-token chunk
]


@pytest.mark.parametrize("t,start,bs,h,hkv,d,dv,window", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_matches_float64_reference(t, start, bs, h, hkv, d, dv, window, dtype):
    kv, ctx = _cache(start + t, bs, hkv, d, dv, dtype, seed=t + start)
    q = torch.randn(t, h, d, generator=torch.Generator().manual_seed(1))
    k, v = kv.gather(0, ctx, torch.float32)  # the cache's exact values (int8: dequantized)
    scale = d**-0.5
    ref = reference(q, k, v, start, scale, window, None)
    assert native_prefill_ok(q, list(kv.layers[0]))
    out = native_prefill_attention(q, *kv.layers[0], ctx, scale, window, None, kv.scales[0])
    # fp32 sums of D products and of up to kv_len weights: 2e-6 of unit-scale outputs
    assert (out.double() - ref).abs().max() < 2e-6


@pytest.mark.parametrize("window", [None, 9])
def test_sinks_match_the_reference(window):
    kv, ctx = _cache(90, 16, 2, 32, 32, torch.float32, seed=7)
    q = torch.randn(40, 8, 32, generator=torch.Generator().manual_seed(2))
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(3)) * 3
    k, v = kv.gather(0, ctx)
    ref = reference(q, k, v, 50, 0.2, window, sinks)
    out = native_prefill_attention(q, *kv.layers[0], ctx, 0.2, window, sinks)
    assert (out.double() - ref).abs().max() < 2e-6


def test_chunks_equal_one_pass_and_threads_do_not_change_results():
    kv, ctx = _cache(200, 16, 2, 32, 32, torch.float32, seed=9)
    q = torch.randn(200, 8, 32, generator=torch.Generator().manual_seed(4))
    whole = native_prefill_attention(q, *kv.layers[0], ctx, 0.2, None)
    cuts = [0, 13, 64, 65, 150, 200]  # chunk edges on and off block and tile boundaries
    parts = [
        native_prefill_attention(q[a:b], *kv.layers[0], ctx[:b], 0.2, None)
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]
    assert torch.equal(torch.cat(parts), whole)  # a row's arithmetic does not see the chunking
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_prefill_attention(q, *kv.layers[0], ctx, 0.2, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, whole)


def test_slot_outside_the_cache_is_an_error_not_a_read():
    kv, ctx = _cache(40, 16, 2, 32, 32, torch.float32, seed=5)
    ctx[17] = kv.layers[0][0].shape[0] + 3
    with pytest.raises(RuntimeError, match="code -2"):
        native_prefill_attention(torch.randn(40, 4, 32), *kv.layers[0], ctx, 0.2, None)


def test_declines_what_it_cannot_run(monkeypatch):
    kv, _ = _cache(16, 16, 2, 32, 32, torch.float32, seed=6)
    q = torch.randn(4, 4, 32)
    assert not native_prefill_ok(q.requires_grad_(), list(kv.layers[0]))
    assert not native_prefill_ok(q.detach().double(), list(kv.layers[0]))
    bf16 = PagedKVCache([[(2, 32), (2, 32)]], 2, 16, torch.bfloat16, "cpu")
    assert not native_prefill_ok(q.detach(), list(bf16.layers[0]))
    monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", "0")
    assert not native_prefill_ok(q.detach(), list(kv.layers[0]))


@pytest.mark.parametrize("family", ["qwen3-moe", "llama", "gpt-oss", "mixtral", "deepseek-v3"])
def test_chunked_prefill_on_the_kernel_equals_one_pass(tiny_model, family, monkeypatch):
    """Through the engine (gpt-oss: sinks and sliding-window layers; deepseek-v3: MLA over its
    expanded K/V): the prompt's logprobs at several chunk sizes equal one pass, and the kernel
    is what ran. Parity of one pass with transformers is tests/model/test_parity.py's."""
    from hetserve import LLM, SamplingParams
    from hetserve.layers import attention, native_prefill

    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return native_prefill_attention(*args, **kwargs)

    monkeypatch.setattr(attention, "native_prefill_attention", spy)
    monkeypatch.setattr(native_prefill, "native_prefill_attention", spy)
    path = tiny_model(family)
    ids = torch.randint(0, 500, (150,), generator=torch.Generator().manual_seed(9)).tolist()
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0, ignore_eos=True)

    def run(**kwargs):
        llm = LLM(path, placement="device", **kwargs)
        calls.clear()  # (loading may run a warm-up forward)
        out = llm.generate(prompt_token_ids=ids, sampling_params=params)[0]
        pairs = zip(out.prompt_logprobs[1:], ids[1:], strict=True)
        lps = torch.tensor([e[t].logprob for e, t in pairs])
        return lps, out.token_ids

    whole, whole_ids = run()
    assert 150 in calls
    for budget in (16, 45):
        lps, token_ids = run(max_num_batched_tokens=budget)
        assert max(calls) <= budget < 150  # it ran in chunks, on the kernel
        torch.testing.assert_close(lps, whole, atol=1e-5, rtol=0)
        assert token_ids == whole_ids


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.float().to(torch.bfloat16).float()


needs_bf16 = pytest.mark.skipif(
    not bf16_products_ok(128, 128), reason="bf16 products need the avx512bf16 build"
)


@needs_bf16
@pytest.mark.parametrize("t,start,bs,h,hkv,d,dv,window", [c for c in CASES if c[5] % 16 == 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_bf16_products_within_their_rounding(t, start, bs, h, hkv, d, dv, window, dtype):
    """bf16 products: against the same attention of q * scale, K and V rounded to bf16 (float64
    otherwise), only the softmax weights' own rounding is left, 2^-9 of each, so
    |error| <= 2^-9 max|V|; against the exact attention within 2^-7 max|V| (the scores' error
    from q and K's rounding moves the weights too)."""
    kv, ctx = _cache(start + t, bs, hkv, d, dv, dtype, seed=t + start)
    q = torch.randn(t, h, d, generator=torch.Generator().manual_seed(1))
    k, v = kv.gather(0, ctx, torch.float32)
    scale = d**-0.5
    out = native_prefill_attention(q, *kv.layers[0], ctx, scale, window, None, kv.scales[0],
                                   bf16=True)  # fmt: skip
    vmax = v.abs().max().item()
    rounded = reference(_bf16(q * scale), _bf16(k), _bf16(v), start, 1.0, window, None)
    assert (out.double() - rounded).abs().max() <= 2**-9 * vmax
    exact = reference(q, k, v, start, scale, window, None)
    err = (out.double() - exact).abs().max()
    assert 1e-5 < err <= 2**-7 * vmax  # the products did run in bf16


@needs_bf16
def test_bf16_products_do_not_see_chunks_or_threads_and_decline_odd_heads():
    kv, ctx = _cache(200, 16, 2, 32, 32, torch.float16, seed=9)
    q = torch.randn(200, 8, 32, generator=torch.Generator().manual_seed(4))
    whole = native_prefill_attention(q, *kv.layers[0], ctx, 0.2, None, bf16=True)
    cuts = [0, 13, 64, 65, 150, 200]
    parts = [
        native_prefill_attention(q[a:b], *kv.layers[0], ctx[:b], 0.2, None, bf16=True)
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]
    assert torch.equal(torch.cat(parts), whole)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native_prefill_attention(q, *kv.layers[0], ctx, 0.2, None, bf16=True),
                           whole)  # fmt: skip
    finally:
        torch.set_num_threads(before)
    # heads off the 16-grid keep fp32 products
    assert not bf16_products_ok(20, 12)
    kv, ctx = _cache(60, 16, 2, 20, 12, torch.float16, seed=3)
    q = torch.randn(60, 4, 20)
    assert torch.equal(native_prefill_attention(q, *kv.layers[0], ctx, 0.2, None, bf16=True),
                       native_prefill_attention(q, *kv.layers[0], ctx, 0.2, None))  # fmt: skip


# MLA's heads: 16 + 16 query / key dimensions, 16 of V (the tiny default's 24 keep fp32)
_MLA16 = {"qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16}


@needs_bf16
@pytest.mark.parametrize("family,extra", [("qwen3-moe", {}), ("deepseek-v3", _MLA16)])
def test_all_int8_prefills_with_bf16_products_within_their_bound(tiny_model, family, extra):
    """`--prefill-attention-dtype auto` under all-int8 (its KV cache fp16): bf16 products, which
    moved the mean |logprob change| against the exact fp32 run by at most 4% here (qwen3-moe,
    four 40-token prompts: 0.00747 -> 0.00778; deepseek-v3's MLA prefill 0.01445 -> 0.01453;
    gpt-oss, llama: within +-1%); `float32` and the exact placement keep fp32 products."""
    from hetserve import LLM
    from tests.model.test_w8a8_model import EVERY_EXPERT, PROMPT_LP, PROMPTS, _mean_change

    path = tiny_model(family, overrides={**EVERY_EXPERT, **extra})

    def run(llm):
        return llm.generate(prompt_token_ids=PROMPTS, sampling_params=PROMPT_LP)

    exact_llm = LLM(path, placement="device")
    assert not exact_llm.engine.runner.kv.bf16_prefill
    exact = run(exact_llm)
    fp32 = LLM(path, placement="all-int8", prefill_attention_dtype="float32")
    bf16 = LLM(path, placement="all-int8")
    assert bf16.engine.runner.kv.bf16_prefill and not fp32.engine.runner.kv.bf16_prefill
    change32, change16 = _mean_change(run(fp32), exact), _mean_change(run(bf16), exact)
    assert change16 != change32 and change16 <= 1.1 * change32, (change16, change32)
