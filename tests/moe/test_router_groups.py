"""Group-limited routing: experts of dropped groups are never selected."""

import torch

from hetserve.moe.router import RouterConfig, TopKRouter


def test_dropped_groups_lose_even_to_negative_choice_scores():
    # Sigmoid scores are all 0.5; the correction bias makes both experts of the kept group
    # score below zero, which a 0-filled mask would let the dropped group's experts beat.
    cfg = RouterConfig(
        num_experts=4,
        top_k=2,
        scoring="sigmoid",
        norm_topk_prob=True,
        n_group=2,
        topk_group=1,
        group_score="top2sum",
        use_correction_bias=True,
    )
    router = TopKRouter(8, cfg)
    router.weight.data.zero_()
    router.e_score_correction_bias.data = torch.tensor([-0.6, -0.7, -2.0, -2.0])
    weights, ids = router(torch.randn(3, 8))
    assert ids.sort(dim=-1).values.tolist() == [[0, 1]] * 3
    torch.testing.assert_close(weights, torch.full((3, 2), 0.5))


def test_correction_bias_stays_fp32_in_a_bf16_model(tiny_model):
    """transformers keeps e_score_correction_bias in fp32; so must we, or bf16 rounding of
    the bias changes which experts are selected."""
    from safetensors import safe_open

    from hetserve import LLM, SamplingParams

    path = tiny_model("glm4-moe")
    llm = LLM(path, device="cpu", dtype="bfloat16")
    routers = [moe.gate for moe in llm.model.moe_layers()]
    assert routers and llm.model.lm_head.weight.dtype == torch.bfloat16
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name, module in llm.model.named_modules():
            if module in routers:
                bias = module.e_score_correction_bias
                assert bias.dtype == torch.float32
                assert torch.equal(bias, f.get_tensor(f"{name}.e_score_correction_bias"))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    assert len(llm.generate(prompt_token_ids=[1, 2, 3], sampling_params=params)[0].token_ids) == 3
