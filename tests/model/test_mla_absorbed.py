"""MLA decode in the latent space (kv_b_proj absorbed) against the expanded keys and values it
replaces: the same logprobs in fp32, every decode step, for each MLA family; and the families
whose kv_b_proj is not a plain linear (int8 under the all-int8 rules) keep expanding."""

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.model import deepseek
from hetserve.model.deepseek import MLAttention
from hetserve.native import native_unavailable_reason


def _decode_logprobs(llm: LLM, prompts: list[list[int]]) -> list[list[float]]:
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return [[next(iter(step.values())).logprob for step in o.logprobs] for o in outs]


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v2", "kimi-linear", "deepseek-v3.2"])
@pytest.mark.parametrize("native", [True, False])
def test_absorbed_decode_equals_expanded(tiny_model, family, native, monkeypatch):
    """On the native decode kernel over the paged latent rows (the CPU's fp32 path) and on
    gathered rows (HETSERVE_NATIVE_KERNELS=0: what other devices run)."""
    path = tiny_model(family, lm_head_scale=8.0)
    prompts = [list(range(10, 17)), list(range(30, 51)), list(range(60, 64))]
    monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", "1" if native else "0")
    llm = LLM(path, placement="device", dtype="float32")
    calls = {"native": 0}
    kernel = deepseek.native_decode_attention

    def counted(*a):
        calls["native"] += 1
        return kernel(*a)

    monkeypatch.setattr(deepseek, "native_decode_attention", counted)
    got = _decode_logprobs(llm, prompts)
    # deepseek-v3.2 attends over its top-k rows, gathered: never the paged kernel
    uses_kernel = native and native_unavailable_reason() is None and family != "deepseek-v3.2"
    assert (calls["native"] > 0) == uses_kernel
    monkeypatch.setattr(MLAttention, "_absorbed", lambda self, like: None)
    want = _decode_logprobs(LLM(path, placement="device", dtype="float32"), prompts)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["float16", "int8"])
def test_absorbed_decode_over_16_and_8_bit_caches(tiny_model, kv_dtype, monkeypatch):
    """The latent rows read in place from an fp16 or int8 cache (the kernel widens them; int8
    applies each row's scale): as the expanding path over the same cache."""
    path = tiny_model("deepseek-v3", lm_head_scale=8.0)
    prompts = [list(range(10, 17)), list(range(30, 51))]
    opts = {"placement": "device", "dtype": "float32", "kv_cache_dtype": kv_dtype}
    got = _decode_logprobs(LLM(path, **opts), prompts)
    monkeypatch.setattr(MLAttention, "_absorbed", lambda self, like: None)
    want = _decode_logprobs(LLM(path, **opts), prompts)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), rtol=0, atol=1e-4)


def test_int8_kv_b_proj_is_absorbed_through_its_dequantized_matrix(tiny_model, monkeypatch):
    """All-int8 (the CPU default): kv_b_proj is an int8 linear; decode absorbs the matrix the
    kernel applies (read once through the identity), which differs from expanding only in
    that the kernel rounds the cached latent rows to int16 first: the same tokens, logprobs
    within 2e-3 (measured 5e-4)."""
    path = tiny_model("deepseek-v3")
    prompts = [list(range(10, 17)), list(range(30, 51))]
    llm = LLM(path, placement="all-int8")
    attn = next(m for m in llm.model.modules() if isinstance(m, MLAttention))
    assert type(attn.kv_b_proj) is not torch.nn.Linear
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1, ignore_eos=True)
    absorbed = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert attn.__dict__.get("_absorbed_cache") is not None
    assert attn.nbytes() == attn.num_heads * (attn.nope_dim + attn.v_dim) * attn.kv_lora_rank * 2
    monkeypatch.setattr(MLAttention, "_absorbed", lambda self, like: None)
    expanded = LLM(path, placement="all-int8").generate(
        prompt_token_ids=prompts, sampling_params=params
    )
    for a, e in zip(absorbed, expanded, strict=True):
        assert a.token_ids == e.token_ids
        la = [next(iter(s.values())).logprob for s in a.logprobs]
        le = [next(iter(s.values())).logprob for s in e.logprobs]
        torch.testing.assert_close(torch.tensor(la), torch.tensor(le), rtol=0, atol=2e-3)


def test_lora_slots_or_another_dtype_keep_expanding(tiny_model):
    from hetserve.layers.lora import LoRALinear

    dense = LLM(tiny_model("deepseek-v3"), placement="device")
    attn = next(m for m in dense.model.modules() if isinstance(m, MLAttention))
    rows = torch.zeros(1, attn.kv_lora_rank + attn.rope_dim)
    assert attn._absorbed(rows) is not None and attn._absorbed(rows.half()) is None
    attn.kv_b_proj = LoRALinear.__new__(LoRALinear)  # a LoRA slot: its deltas are per request
    assert attn._absorbed(rows) is None


def test_fp16_head_products_native_and_fallback_match_fp32(tiny_model, monkeypatch):
    """The fp16 per-head matrices (all-int8 on the CPU) on the native kernel and, with native
    kernels off, on torch: both as the fp32 matrix's products to fp16's rounding."""
    from hetserve.model.deepseek import _Absorbed

    attn = next(
        m for m in LLM(tiny_model("deepseek-v3"), placement="device").model.modules()
        if isinstance(m, MLAttention)
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    h, nope, v, rank = attn.num_heads, attn.nope_dim, attn.v_dim, attn.kv_lora_rank
    w = torch.randn(h * (nope + v), rank, generator=g)
    exact, half = _Absorbed(attn, w), _Absorbed(attn, w, half=True)
    q, o = torch.randn(3, h, nope, generator=g), torch.randn(3, h, rank, generator=g)
    want_q, want_o = exact.query(q), exact.output(o)
    for native in ("1", "0"):
        monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", native)
        for got, want in ((half.query(q), want_q), (half.output(o), want_o)):
            assert got.shape == want.shape
            scale = want.abs().max()
            assert (got - want).abs().max() <= 2e-3 * scale and scale > 0
