"""--kv-cache-dtype: the paged KV cache stored in 16 bits while the model computes in fp32."""

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
                num_kv_blocks=32,
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


def test_block_identity_carries_the_kv_dtype(run):
    seeds = {run("qwen3-moe", d)[0].kv_info()["hash_seed"] for d in BOUND.keys() | {"float32"}}
    assert len(seeds) == 3  # no tier, pool or hand-off can take one dtype's block for another
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
