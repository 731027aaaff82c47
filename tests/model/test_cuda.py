"""CUDA paths: run where a GPU exists, skipped elsewhere.

Two bounds, each against a reference:
- fp32 on CUDA (paged attention GQA/MLA, linear-attention state, the sparse indexer, chunked
  prefill) equals fp32 on the CPU: max |delta logprob| < 1e-3 (reduction order on the GPU; the
  tiny checkpoints multiply their logits by 8, so 1e-3 is ~1e-4 of an unscaled model).
- bf16 on CUDA (the default there) is off fp32 by about what transformers' own bf16 is:
  mean |delta| <= 2x transformers' bf16-on-CUDA error + 0.01. These tiny random models with
  scaled logits are harsh on bf16 (transformers' own mean error is 0.08 to 1.6 on them), so a
  fixed bound would either pass a broken kernel or fail rounding. Measured on an H200
  (2026-11-26): ours / transformers' from 0.55 (qwen3-next) to 1.6 (qwen3.5-moe, whose routed
  experts add the difference: 1.3x at layer 0's MoE block, the same on the CPU in bf16).
"""

import pytest
import torch

from hetserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu

FAMILIES = [
    "qwen3-moe", "deepseek-v3", "mixtral", "qwen3-next", "qwen3.5-moe", "kimi-linear",
    "deepseek-v3.2", "minimax-m2",
]  # fmt: skip
IDS = torch.randint(10, 400, (160,), generator=torch.Generator().manual_seed(3)).tolist()
PROMPT_LP = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0, ignore_eos=True)


def prompt_logprobs(out, ids=IDS) -> torch.Tensor:
    return torch.tensor(
        [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    )


def ours(path, ids=IDS, **options):
    llm = LLM(path, **options)
    try:
        return llm.generate(prompt_token_ids=ids, sampling_params=PROMPT_LP)[0]
    finally:
        llm.close()


def transformers_logprobs(path, device: str, dtype: torch.dtype, ids=IDS) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=device)).logits[0].float().cpu()
    del model
    return logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_fp32_equals_cpu_fp32_chunked(tiny_model, family):
    path = tiny_model(family, lm_head_scale=8.0)
    cpu = ours(path, device="cpu", placement="device")
    gpu = ours(path, device="cuda", dtype="float32", placement="device", max_num_batched_tokens=64)
    delta = (prompt_logprobs(gpu) - prompt_logprobs(cpu)).abs()
    assert delta.max() < 1e-3, (family, delta.max().item())
    assert gpu.token_ids == cpu.token_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_bf16_within_transformers_bf16_error(tiny_model, family):
    path = tiny_model(family, lm_head_scale=8.0)
    fp32 = prompt_logprobs(ours(path, device="cpu", placement="device"))
    llm = LLM(path, device="cuda")
    try:
        assert next(llm.model.parameters()).dtype == torch.bfloat16
        bf16 = prompt_logprobs(llm.generate(prompt_token_ids=IDS, sampling_params=PROMPT_LP)[0])
        sampled = llm.generate(
            prompt_token_ids=IDS, sampling_params=SamplingParams(max_tokens=8, seed=1)
        )[0]
        assert len(sampled.token_ids) == 8 or sampled.finish_reason == "stop"
    finally:
        llm.close()
    ref32 = transformers_logprobs(path, "cpu", torch.float32)
    ref16 = transformers_logprobs(path, "cuda", torch.bfloat16)
    assert (ref32 - fp32).abs().max() < 1e-3  # the CPU reference is transformers' fp32
    theirs, mine = (ref16 - ref32).abs().mean(), (bf16 - fp32).abs().mean()
    assert mine <= 2 * theirs + 0.01, (family, mine.item(), theirs.item())
