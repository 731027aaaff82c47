"""CUDA paths (bf16 by default): run where a GPU exists, skipped elsewhere."""

import pytest
import torch

from hetserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3", "mixtral"])
def test_cuda_bf16_tracks_cpu_fp32(tiny_model, family):
    path = tiny_model(family, lm_head_scale=8.0)
    ids = torch.randint(10, 400, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0, logprobs=1)
    cpu = LLM(path, device="cpu").generate(prompt_token_ids=ids, sampling_params=params)[0]
    gpu_llm = LLM(path, device="cuda")
    assert next(gpu_llm.model.parameters()).dtype == torch.bfloat16
    gpu = gpu_llm.generate(prompt_token_ids=ids, sampling_params=params)[0]
    a = torch.tensor([e[t].logprob for e, t in zip(cpu.prompt_logprobs[1:], ids[1:], strict=True)])
    b = torch.tensor([e[t].logprob for e, t in zip(gpu.prompt_logprobs[1:], ids[1:], strict=True)])
    assert (a - b).abs().mean() < 0.05  # bf16 rounding, not a different model
    sampled = gpu_llm.generate(
        prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=8, temperature=1.0, seed=1)
    )[0]
    assert len(sampled.token_ids) == 8 or sampled.finish_reason == "stop"
