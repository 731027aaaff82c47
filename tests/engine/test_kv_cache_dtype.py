"""--kv-cache-dtype: the paged KV cache stored in 16 or 8 bits while the model computes in fp32."""

import subprocess
import sys

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.disagg.profiler import _kv_bytes_per_block
from hetserve.errors import InvalidInputError

# Largest |logprob(16-bit cache) - logprob(fp32 cache)| (nats) over a 186-token prompt and 16
# greedy tokens, measured on the tiny qwen3-moe and deepseek-v3 (MLA) checkpoints: bfloat16
# 3.6e-3 / 7.8e-3, float16 3.4e-4 / 5.7e-4. The bounds leave ~2.5x room for other seeds.
BOUND = {"bfloat16": 0.02, "float16": 0.002}
# The 8-bit caches (a scale per token and KV head; tests/layers/test_kv_int8.py derives and
# checks the bound of one attention read). Measured over the same 201 logprobs, qwen3-moe /
# deepseek-v3: int8 mean 3.0e-3 / 8.3e-3 nats, largest 0.24 / 0.75 at one position each (the
# next largest 0.03 / 0.24); fp8 (e4m3) mean 1.3e-2 / 4.3e-2, largest 0.30 / 0.95. The single
# large moves are routing flips: a perturbed hidden state sends a token to another expert (the
# fp16 cache's 20x smaller perturbation flips none here). So the stated bound is on the mean,
# with 2.5x room, and on the largest single move (1 nat, routing flips included).
MEAN_BOUND_8BIT = {"int8": 0.025, "fp8": 0.1}
MAX_BOUND_8BIT = 1.0
PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


@pytest.fixture(scope="module")
def run(tiny_model):
    """run(family, kv dtype) -> (engine, greedy ids, prompt logprobs, generated logprobs)."""
    made: dict = {}

    def go(family: str, kv_dtype: str):
        if (family, kv_dtype) not in made:
            llm = LLM(
                model=str(tiny_model(family)),
                kv_cache_dtype=kv_dtype,
                prefill_attention_dtype="float32",  # the cache's own error (bf16 products:
                num_kv_blocks=32,  # tests/layers/test_native_prefill.py)
                max_model_len=256,
            )
            sp = SamplingParams(max_tokens=16, temperature=0.0, logprobs=0, prompt_logprobs=0)
            out = llm.generate([PROMPT], sp)[0]
            pairs = zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:], strict=True)
            prompt = [d[t].logprob for d, t in pairs]
            c = out.outputs[0]
            gen = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)]
            made[family, kv_dtype] = (llm.engine, c.token_ids, prompt, gen)
        return made[family, kv_dtype]

    return go


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_16bit_cache_logprobs_within_bound_and_same_greedy_output(run, family, kv_dtype):
    engine, ids, prompt, gen = run(family, kv_dtype)
    _, ref_ids, ref_prompt, ref_gen = run(family, "float32")
    assert engine.runner.kv.layers[0][0].dtype is getattr(torch, kv_dtype)
    assert next(engine.model.parameters()).dtype is torch.float32  # the model computes in fp32
    assert ids == ref_ids
    err = max(abs(a - b) for a, b in zip(prompt + gen, ref_prompt + ref_gen, strict=True))
    assert err < BOUND[kv_dtype]


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3"])
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_8bit_cache_logprobs_within_bound(run, family, kv_dtype):
    engine, ids, prompt, gen = run(family, kv_dtype)
    _, ref_ids, ref_prompt, ref_gen = run(family, "float32")
    kv = engine.runner.kv
    assert kv.quantized and kv.scales[0][0].dtype is torch.float32
    errs = [abs(a - b) for a, b in zip(prompt + gen, ref_prompt + ref_gen, strict=True)]
    assert sum(errs) / len(errs) < MEAN_BOUND_8BIT[kv_dtype]
    assert max(errs) < MAX_BOUND_8BIT
    if kv_dtype == "int8":
        assert ids == ref_ids  # (fp8 changes one greedy token of deepseek-v3's 16)


def test_block_identity_carries_the_kv_dtype(run):
    dtypes = BOUND.keys() | {"float32", "int8", "fp8"}
    seeds = {run("qwen3-moe", d)[0].kv_info()["hash_seed"] for d in dtypes}
    assert len(seeds) == 5  # no tier, pool or hand-off can take one dtype's block for another
    assert run("qwen3-moe", "auto")[0].kv_info()["hash_seed"] in seeds  # auto: the model's


def test_blocks_per_gib_double_at_16_bit(tiny_model):
    model = str(tiny_model("qwen3-moe"))
    engines = {
        d: LLM(
            model=model, kv_cache_dtype=d, kv_cache_gb=1 / 256, max_model_len=64, max_num_seqs=256
        ).engine
        for d in ("float32", "bfloat16")
    }
    n32, n16 = (engines[d].runner.kv.num_blocks for d in ("float32", "bfloat16"))
    assert n16 in (2 * n32, 2 * n32 + 1)  # the same bytes, floor-divided by half the block
    per32, per16 = (_kv_bytes_per_block(engines[d]) for d in ("float32", "bfloat16"))
    assert per32 == 2 * per16  # what profiles and tier sizing count per token
    assert all(e.runner.kv.nbytes() <= (1 << 30) // 256 for e in engines.values())


def test_blocks_per_gib_near_quadruple_at_8_bit(tiny_model):
    model = str(tiny_model("qwen3-moe"))
    budget = (1 << 30) // 256
    engines = {
        d: LLM(
            model=model, kv_cache_dtype=d, kv_cache_gb=1 / 256, max_model_len=64, max_num_seqs=1024
        ).engine  # enough sequences that the byte budget, not their count, sets the blocks
        for d in ("float32", "int8")
    }
    per32, per8 = (_kv_bytes_per_block(engines[d]) for d in ("float32", "int8"))
    head_dim = engines["int8"].runner.kv.layers[0][0].shape[-1]
    # 4 bytes a value -> 1 byte a value plus a 4-byte scale per head_dim values
    assert per32 * (head_dim + 4) == per8 * 4 * head_dim
    n32, n8 = (engines[d].runner.kv.num_blocks for d in ("float32", "int8"))
    assert (n32, n8) == (budget // per32, budget // per8)
    assert all(e.runner.kv.nbytes() <= budget for e in engines.values())  # scales counted


def test_an_int8_prefix_from_a_kv_tier_brings_its_scales(tiny_model):
    """Blocks saved to a tier and loaded back into a wiped cache give the int8 engine's own
    logprobs: the scales travel with the rows (BlockIO's parts)."""
    model = str(tiny_model("qwen3-moe"))
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    prompt = list(range(10, 110))  # 6 full blocks of 16
    opts = {"kv_cache_dtype": "int8", "placement": "device", "max_model_len": 256}
    ref = LLM(model=model, **opts).generate(prompt_token_ids=prompt, sampling_params=sp)[0]
    llm = LLM(model=model, num_kv_blocks=40, kv_store="local://?dram=64M", **opts)
    try:
        cost = llm.engine.tiers.cost
        cost.prefill_tokens_per_s, cost.observe_prefill = 1.0, lambda *a: None  # always load
        llm.generate(prompt_token_ids=prompt, sampling_params=sp)
        assert llm.engine.tiers.flush()
        llm.reset_prefix_cache()
        for t in llm.engine.runner.kv.parts():  # rows and scales: only the tier has them now
            t.zero_()
        out = llm.generate(prompt_token_ids=prompt, sampling_params=sp)[0]
    finally:
        llm.close()
    assert out.num_cached_tokens == 96 and out.cached_tokens_by_tier == {"dram": 96}
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    mine, theirs = out.outputs[0], ref.outputs[0]
    for a, b, t in zip(mine.logprobs, theirs.logprobs, theirs.token_ids, strict=True):
        assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5)


def test_bad_kv_cache_dtype_is_a_one_line_error():
    with pytest.raises(InvalidInputError, match="kv_cache_dtype must be one of"):
        LLM(kv_cache_dtype="float64")
    r = subprocess.run(
        [sys.executable, "-m", "hetserve.cli", "generate", "--kv-cache-dtype", "fp64", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "--kv-cache-dtype" in lines[0]


def test_auto_is_fp16_on_the_cpu_under_all_int8_and_the_model_dtype_where_exact(tiny_model):
    """`--kv-cache-dtype auto` (the default): half the bytes on the CPU under the all-int8
    preset (approximate already; the native kernels widen fp16 in registers); `device` keeps
    fp32."""
    from hetserve.kv.paged import resolve_kv_dtype

    assert resolve_kv_dtype("auto", torch.float32, half=True) is torch.float16
    assert resolve_kv_dtype("auto", torch.float32) is torch.float32
    assert resolve_kv_dtype("auto", torch.bfloat16, half=True) is torch.bfloat16
    assert resolve_kv_dtype("float32", torch.float32, half=True) is torch.float32
    path = str(tiny_model("qwen3-moe"))
    kw = {"num_kv_blocks": 32, "max_model_len": 256}
    fast = LLM(model=path, placement="all-int8", **kw).engine
    exact = LLM(model=path, placement="device", **kw).engine
    assert fast.kv_info()["kv_cache_dtype"] == "float16"
    assert fast.runner.kv.layers[0][0].dtype is torch.float16
    assert exact.kv_info()["kv_cache_dtype"] == "float32"
    pinned = LLM(model=path, placement="all-int8", kv_cache_dtype="float32", **kw).engine
    assert pinned.kv_info()["kv_cache_dtype"] == "float32"
