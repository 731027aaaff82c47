"""The tiny checkpoints' configs: each supported family's HF config.json at test size, with the
options its published models use switched on, so that the tests and the demo reach every path
(`tiny.py` writes the weights and tokenizer beside them).

Who calls it: `tiny.make_tiny_checkpoint`, `hetserve models make-tiny`, the parity tests (which
walk `FAMILIES`). Failure contract: an unknown family is an `InvalidInputError` naming the
choices.
"""

from __future__ import annotations

import copy

from hetserve.errors import InvalidInputError
from hetserve.testing.tiny_tiktoken import MODEL_VOCAB_SIZE as KIMI_VOCAB_SIZE

_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "dtype": "float32",
}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
_MLA = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 3,
    "n_routed_experts": 8,
}
# DeepSeek-V3's YaRN scaling (V3 and V3.2 alike), at the tiny models' context.
_DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

FAMILIES: dict[str, dict] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    },
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16},
    "qwen2-moe": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        **_MOE,
        "num_experts": 8,
        "shared_expert_intermediate_size": 64,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "num_hidden_layers": 3,
        "qkv_bias": True,
    },
    "qwen3-moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **_MOE,
        "num_experts": 8,
        "norm_topk_prob": True,
        "head_dim": 16,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
    },
    "deepseek-v2": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        **_MOE,
        **_MLA,
        "q_lora_rank": None,
        "topk_method": "group_limited_greedy",
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **_MOE,
        **_MLA,
        "q_lora_rank": 32,
        "topk_method": "noaux_tc",
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "rope_interleave": True,
        "num_nextn_predict_layers": 0,
        "rope_parameters": _DEEPSEEK_YARN,
    },
    # GLM-4.5's options (partial rotary 0.5, qk norm, q/k/v bias, leading dense layer, shared
    # expert, scaled sigmoid routing) with groups on so that the group-limited path runs too.
    "glm4-moe": {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        **_MOE,
        "head_dim": 32,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "use_qk_norm": True,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 3,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    # Kimi-K2: DeepSeek-V3 with one group, top-8, 2.827 scaling, YaRN as in its config.json
    # (old-style rope_scaling, beta_fast = beta_slow = 1), and a tiktoken-format tokenizer.
    "kimi-k2": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **_MOE,
        **_MLA,
        "n_routed_experts": 16,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 16,
        "q_lora_rank": 32,
        "topk_method": "noaux_tc",
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.827,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "num_nextn_predict_layers": 0,
        "vocab_size": KIMI_VOCAB_SIZE,
        "rope_parameters": None,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
    "gpt-oss": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "num_hidden_layers": 3,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,  # the experts' (gpt-oss has no dense MLP)
        "head_dim": 16,
        "attention_bias": True,
        "rms_norm_eps": 1e-5,
        # Alternating windows as published (sliding first), a window the tests' prompts cross.
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 8,
        "swiglu_limit": 1.0,  # published: 7.0; small enough here that both clamps engage
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    },
}
# The linear-attention families as published: shapes small, layer patterns kept (three linear
# layers to one full one), q/k heads grouped over more v heads where the family does.
_LINEAR_QWEN = {
    **_MOE,
    "num_experts": 8,
    "shared_expert_intermediate_size": 32,
    "head_dim": 16,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "partial_rotary_factor": 0.25,
}
FAMILIES.update(
    {
        "qwen3-next": {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            **_LINEAR_QWEN,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
            },
        },
        "qwen3.5-moe": {
            "architectures": ["Qwen3_5MoeForCausalLM"],
            "model_type": "qwen3_5_moe_text",
            **_LINEAR_QWEN,
            "intermediate_size": None,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0],
                "mrope_interleaved": True,
            },
        },
        # Kimi-Linear's published config keys (Moonshot's names), KDA layers 1-3 and MLA 4.
        "kimi-linear": {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            **_MLA,
            "num_hidden_layers": 4,
            "q_lora_rank": None,
            "n_routed_experts": None,
            "num_experts": 8,
            "num_experts_per_token": 2,
            "moe_intermediate_size": 32,
            "num_shared_experts": 1,
            "n_shared_experts": None,
            "first_k_dense_replace": 1,
            "moe_renormalize": True,
            "routed_scaling_factor": 2.446,
            "num_expert_group": 1,
            "topk_group": 1,
            "moe_router_activation_func": "sigmoid",
            "mla_use_nope": True,
            "model_max_length": 1024,
            "max_position_embeddings": None,
            "rms_norm_eps": 1e-5,
            "linear_attn_config": {
                "head_dim": 16,
                "num_heads": 4,
                "short_conv_kernel_size": 4,
                "kda_layers": [1, 2, 3],
                "full_attn_layers": [4],
            },
            "vocab_size": KIMI_VOCAB_SIZE,
            "rope_parameters": None,
            "rope_theta": 10000.0,
        },
        # DeepSeek-V3.2: V3 plus the indexer; top-k small enough that the tests' prompts
        # select, heads enough that exact score ties (which break differently) stay unlikely.
        "deepseek-v3.2": {
            "architectures": ["DeepseekV32ForCausalLM"],
            "model_type": "deepseek_v32",
            **_MOE,
            **_MLA,
            "q_lora_rank": 32,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "index_topk": 16,
            "index_head_dim": 32,
            "index_n_heads": 16,
            "num_nextn_predict_layers": 0,
            "rope_parameters": _DEEPSEEK_YARN,
        },
        # MiniMax-M2 as published: rotary_dim (half the head), q/k norm over all heads,
        # sigmoid routing with a correction bias.
        "minimax-m2": {
            "architectures": ["MiniMaxM2ForCausalLM"],
            "model_type": "minimax_m2",
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "head_dim": 16,
            "rotary_dim": 8,
            "use_qk_norm": True,
            "qk_norm_type": "per_layer",
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "rope_parameters": None,
            "rope_theta": 5000000.0,
        },
    }
)
KIMI_TOKENIZER = ("kimi-k2", "kimi-linear")
DEMO_FAMILY = "qwen3-moe"
DEMO_OVERRIDES = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_experts": 16,
    "moe_intermediate_size": 64,
    "num_attention_heads": 8,
    "head_dim": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
}
_DROP_IF_NONE = (
    "intermediate_size",
    "n_routed_experts",
    "n_shared_experts",
    "max_position_embeddings",
)


def tiny_config(family: str, vocab_size: int, overrides: dict | None = None) -> dict:
    if family not in FAMILIES:
        raise InvalidInputError(
            f"unknown family {family!r}; choose one of: {', '.join(sorted(FAMILIES))}"
        )
    cfg = {**copy.deepcopy(_COMMON), **copy.deepcopy(FAMILIES[family])}
    cfg.update(overrides or {})
    for key in [k for k, v in cfg.items() if v is None and k in _DROP_IF_NONE]:
        del cfg[key]  # keys a family's published config does not have
    # Padded to a multiple of 64 as published models pad theirs (the chat formats' marker
    # tokens would leave odd sizes that quantized kernels' row blocks do not take).
    cfg["vocab_size"] = max(int(cfg.get("vocab_size") or 0), -(-vocab_size // 64) * 64)
    return cfg
