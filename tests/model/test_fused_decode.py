"""The fused decode step (model/fused_decode.py): every decoder layer of a CPU-only decode step
in one native call gives what the modules give, and steps aside where it does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import yaml

from hetserve import LLM, SamplingParams
from hetserve.bench.decode import _all_int8_rules
from hetserve.model import fused_decode
from hetserve.moe.router import NATIVE_LOGITS_MAX_TOKENS, native_logits
from hetserve.native import native_unavailable_reason

pytestmark = pytest.mark.skipif(
    bool(native_unavailable_reason()), reason="native kernels unavailable"
)

# Shapes the native int8 linears and experts take (rows % 4, columns % 32).
MOE = {"hidden_size": 128, "moe_intermediate_size": 64, "head_dim": 32, "num_experts": 16}
MOE_TOP4 = {**MOE, "num_experts_per_tok": 4}  # deferral keeps 2 on time: needs top_k >= 3
DENSE = {"hidden_size": 128, "intermediate_size": 192, "head_dim": 32}
INT8_LINEARS = {"name": "int8-linears", "match": ".*", "device": "cpu", "backend": "cpu-int8"}
PROMPTS = [list(range(10, 31)), list(range(40, 45)), list(range(100, 112))]


class _Spy:
    """Wraps the model's fused step (the runner sets fused_decode.run): counts the steps it
    took, or (off) refuses every step."""

    def __init__(self, monkeypatch, llm: LLM) -> None:
        assert llm.model.fused_step is fused_decode.run
        self.fused, self.off, self._run = 0, False, fused_decode.run
        monkeypatch.setattr(llm.model, "fused_step", self)

    def __call__(self, model, x, ctx) -> bool:
        if self.off:
            return False
        took = self._run(model, x, ctx)
        self.fused += took
        return took


def _generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    return [
        (o.outputs[0].token_ids,
         [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                        strict=True)])
        for o in outs
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("family", "shape", "experts", "kv_dtype", "bits"),
    [("qwen3-moe", MOE, "cpu-int8", "auto", 16), ("qwen3-moe", MOE, "cpu-int4", "auto", 16),
     ("qwen3-moe", {**MOE, "norm_topk_prob": False}, "cpu-int8", "auto", 16),
     ("qwen3-moe", MOE, "cpu-int8", "float16", 16),  # an fp16 KV cache: the C side converts
     ("qwen3-moe", MOE, "cpu-int8", "int8", 16),  # int8 rows with their scales
     ("qwen3-moe", MOE, "cpu-int8", "auto", 8),  # W8A8: the fused step's formats carry it too
     ("llama", DENSE, None, "auto", 16), ("qwen2", DENSE, None, "auto", 16),
     ("llama", DENSE, None, "auto", 8)],
)  # fmt: skip
def test_fused_step_gives_the_modules_results(
    tiny_model, monkeypatch, tmp_path, family, shape, experts, kv_dtype, bits
):
    if experts:
        rules = _all_int8_rules(experts)
    else:  # a dense model: every linear int8 on the CPU
        rules = str(tmp_path / "int8.yaml")
        with open(rules, "w") as f:
            yaml.safe_dump({"rules": [INT8_LINEARS]}, f)
    llm = LLM(str(tiny_model(family, overrides=shape)), placement=rules, kv_cache_dtype=kv_dtype,
              activation_bits=bits)  # fmt: skip
    spy = _Spy(monkeypatch, llm)
    fused = _generate(llm)
    assert spy.fused == 7  # every decode step after the prefill (the batch decodes together)
    spy.off = True
    modules = _generate(llm)
    for (tf, lf), (tm, lm) in zip(fused, modules, strict=True):
        assert tf == tm
        if experts:  # the same kernels on the same inputs: the same bits
            assert lf == lm
        else:  # the dense MLP's silu is the C one here, torch's there: fp32 rounding apart
            # (measured up to 2.8e-5 on a logprob of -4: 7e-6 relative)
            torch.testing.assert_close(torch.tensor(lf), torch.tensor(lm), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("kv_dtype", "kv_proj"),
    [("auto", "same"), ("float16", "same"), ("int8", "same"), ("auto", "q8_0")],
)
def test_q_k_v_kept_apart_take_the_fused_step_too(tiny_model, monkeypatch, kv_dtype, kv_proj):
    """A GGUF file whose q, k and v are of different types keeps them as three linears (layers/
    int8_linear.py `_fuse`); the fused step runs them as three and gives the modules' bits.
    Here fusion is turned off: three linears of one format, or (q8_0) k / v replaced by
    q8_0-style groups of 32 beside q's int8 rows with a scale per row (as a GGUF file's q4_K q
    beside q8_0 k / v, which this shape cannot hold)."""
    from hetserve.layers import int8_linear
    from hetserve.quant.packed import Int8Rows

    monkeypatch.setattr(int8_linear, "_fuse", lambda module, bits=16: 0)
    llm = LLM(str(tiny_model("qwen3-moe", overrides=MOE)), placement=_all_int8_rules("cpu-int8"),
              kv_cache_dtype=kv_dtype)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for layer in llm.model.model.layers:
        attn = layer.mixer
        assert attn.qkv_proj is None and isinstance(attn.k_proj, int8_linear.Int8Linear)
        for name in ("k_proj", "v_proj") if kv_proj == "q8_0" else ():
            old = getattr(attn, name)
            lin = torch.nn.Linear(old.in_features, old.out_features, bias=False)
            w = torch.randn(old.out_features, old.in_features, generator=g) * 0.05
            lin.packed_weight = Int8Rows.q8_0(w)
            setattr(attn, name, int8_linear.Int8Linear(lin))
        groups = (0, 32) if kv_proj == "q8_0" else (0, 0)
        assert (attn.q_proj.group, attn.k_proj.group) == groups
    spy = _Spy(monkeypatch, llm)
    fused = _generate(llm)
    assert spy.fused == 7
    spy.off = True
    assert fused == _generate(llm)


def test_fused_step_steps_aside(tiny_model, monkeypatch):
    path = str(tiny_model("qwen3-moe", overrides=MOE_TOP4))
    llm = LLM(path, placement=_all_int8_rules("cpu-int8"))
    spy = _Spy(monkeypatch, llm)
    _generate(llm)
    assert spy.fused
    llm.model.set_expert_deferral(1)  # deferred experts run beside the next layer
    spy.fused = 0
    _generate(llm)
    assert spy.fused == 0
    llm.model.set_expert_deferral(0)  # the plan follows the model back
    _generate(llm)
    assert spy.fused == 7
    monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", "0")
    spy.fused = 0
    _generate(llm)
    assert spy.fused == 0


def test_models_it_does_not_cover_take_the_modules(tiny_model, monkeypatch):
    # fp32 linears (no placement) and DeepSeek's MLA: nothing to chain in C
    for family, shape in (("qwen3-moe", MOE), ("deepseek-v3", None)):
        llm = LLM(str(tiny_model(family, overrides=shape)), placement="device")
        spy = _Spy(monkeypatch, llm)
        _generate(llm)
        assert spy.fused == 0
        monkeypatch.undo()


def test_router_logits_fixed_order_and_close_to_torch():
    g = torch.Generator().manual_seed(0)
    # 18 rows and 7 tokens: whole and partial blocks of rows x tokens; 100 columns: a tail
    x, w = torch.randn(7, 100, generator=g), torch.randn(18, 100, generator=g)
    batch = native_logits(x, w)
    assert batch is not None
    torch.testing.assert_close(batch, F.linear(x, w), rtol=1e-5, atol=1e-5)
    for t in range(7):  # each row's bits do not depend on the batch it came in
        assert torch.equal(native_logits(x[t : t + 1], w), batch[t : t + 1])
    big = torch.randn(NATIVE_LOGITS_MAX_TOKENS + 1, 100, generator=g)
    assert native_logits(big, w) is None  # prefill-sized batches stay on torch's GEMM
    assert native_logits(x.requires_grad_(), w) is None


@pytest.mark.parametrize(
    ("family", "shape", "kv_dtype"),
    [("qwen3-moe", MOE, "auto"), ("qwen3-moe", MOE, "int8"), ("llama", DENSE, "float16")],
)
def test_small_prompt_chunks_beside_decodes_take_the_fused_step(
    tiny_model, monkeypatch, tmp_path, family, shape, kv_dtype
):
    """A step budget of 8 tokens: the longer prompts go in chunks of up to 7 beside the others'
    decodes, each chunk token a row of decode attention over its own context in the fused
    step. The modules run those chunks on the prefill kernels (fp32 products here): the same
    tokens, logprobs within fp32 rounding (the two attentions sum in other orders)."""
    if shape is MOE:
        rules = _all_int8_rules("cpu-int8")
    else:
        rules = str(tmp_path / "int8.yaml")
        with open(rules, "w") as f:
            yaml.safe_dump({"rules": [INT8_LINEARS]}, f)
    llm = LLM(str(tiny_model(family, overrides=shape)), placement=rules,
              kv_cache_dtype=kv_dtype, max_num_batched_tokens=8,
              prefill_attention_dtype="float32")  # fmt: skip
    spy = _Spy(monkeypatch, llm)
    mixed = []
    run = spy._run

    def spying(model, x, ctx):
        if ctx.meta.seqs and ctx.meta.decode is not None:
            mixed.append(sum(s.q_len for s in ctx.meta.seqs))
        return run(model, x, ctx)

    spy._run = spying
    fused = _generate(llm)
    assert mixed and max(mixed) > 1  # steps with decodes carried chunks of several tokens
    assert spy.fused > 7  # ... and took the fused step
    spy.off = True
    modules = _generate(llm)
    for (tf, lf), (tm, lm) in zip(fused, modules, strict=True):
        assert tf == tm
        torch.testing.assert_close(torch.tensor(lf), torch.tensor(lm), rtol=1e-4, atol=1e-4)


def test_large_prompt_chunks_keep_the_prefill_kernels(tiny_model, monkeypatch):
    llm = LLM(str(tiny_model("qwen3-moe", overrides=MOE)), placement=_all_int8_rules("cpu-int8"),
              max_num_batched_tokens=64)  # fmt: skip
    spy = _Spy(monkeypatch, llm)
    taken = []
    run = spy._run

    def spying(model, x, ctx):
        took = run(model, x, ctx)
        if ctx.meta.seqs:
            taken.append((sum(s.q_len for s in ctx.meta.seqs), took))
        return took

    spy._run = spying
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate(prompt_token_ids=[PROMPTS[1], list(range(10, 110))], sampling_params=params)
    chunks = [n for n, _ in taken]
    assert any(n > fused_decode.FUSED_CHUNK_TOKENS for n in chunks), chunks
    assert all(took == (n <= fused_decode.FUSED_CHUNK_TOKENS) for n, took in taken), taken
