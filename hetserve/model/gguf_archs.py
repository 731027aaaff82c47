"""What differs per GGUF architecture beyond the Qwen-MoE defaults: llama.cpp's tensor names
for the family's own modules, its metadata keys as an HF config, and tensors llama.cpp's
converter splits that the HF layout keeps whole.

Who calls it: `GgufCheckpoint` (model/gguf_file.py). Pure mapping, no I/O; a key the config
needs that the file lacks is a ModelLoadError naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hetserve.errors import ModelLoadError

_L = r"^blk\.(\d+)\."
_ATTN = r"model.layers.\1.self_attn."
_MLP = r"model.layers.\1.mlp."
# deepseek2 (DeepSeek-V2/V3/R1, Kimi-K2): MLA projections and shared experts.
DEEPSEEK2_NAMES = [
    (_L + r"attn_q_a\.weight$", _ATTN + "q_a_proj.weight"),
    (_L + r"attn_q_a_norm\.weight$", _ATTN + "q_a_layernorm.weight"),
    (_L + r"attn_q_b\.weight$", _ATTN + "q_b_proj.weight"),
    (_L + r"attn_kv_a_mqa\.weight$", _ATTN + "kv_a_proj_with_mqa.weight"),
    (_L + r"attn_kv_a_norm\.weight$", _ATTN + "kv_a_layernorm.weight"),
    (_L + r"attn_kv_b\.weight$", _ATTN + "kv_b_proj.weight"),
    (_L + r"ffn_(gate|up|down)_shexp\.weight$", _MLP + r"shared_experts.\2_proj.weight"),
    (_L + r"exp_probs_b\.bias$", _MLP + "gate.e_score_correction_bias"),
]  # fmt: skip


# glm4moe (GLM-4.5 / 4.6): DeepSeek's MoE layout (shared experts, router bias), its own norm name.
GLM4MOE_NAMES = [
    (_L + r"post_attention_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    *DEEPSEEK2_NAMES[-2:],
]


def glm4moe_config(field: Callable[[str], Any], arch: str, tensors: set[str]) -> dict[str, Any]:
    """HF config keys of a glm4moe file (partial rotary: rope.dimension_count of key_length)."""
    head_dim = int(field(f"{arch}.attention.key_length") or 0)
    rope = int(field(f"{arch}.rope.dimension_count") or head_dim)
    return {
        "n_routed_experts": field(f"{arch}.expert_count"),
        "n_shared_experts": int(field(f"{arch}.expert_shared_count") or 0),
        "first_k_dense_replace": int(field(f"{arch}.leading_dense_block_count") or 0),
        "n_group": field(f"{arch}.expert_group_count") or 1,
        "topk_group": field(f"{arch}.expert_group_used_count") or 1,
        "routed_scaling_factor": float(field(f"{arch}.expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(field(f"{arch}.expert_weights_norm") or False),
        "num_nextn_predict_layers": int(field(f"{arch}.nextn_predict_layers") or 0),
        "partial_rotary_factor": rope / head_dim if head_dim else 1.0,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors,
    }


def deepseek2_config(field: Callable[[str], Any], arch: str) -> dict[str, Any]:
    """HF config keys of a deepseek2 file: llama.cpp writes the MLA sizes as key_length_mla /
    value_length_mla (older files: key_length / value_length) and the router's kind as
    expert_gating_func (1 softmax: DeepSeek-V2, 2 sigmoid: V3 and later, with a bias)."""

    def need(key: str) -> Any:
        value = field(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF deepseek2 file lacks metadata key {arch}.{key}")
        return value

    rope = int(need("rope.dimension_count"))
    key_len = field(f"{arch}.attention.key_length_mla") or need("attention.key_length")
    value_len = field(f"{arch}.attention.value_length_mla") or need("attention.value_length")
    sigmoid = int(field(f"{arch}.expert_gating_func") or 1) == 2
    groups = field(f"{arch}.expert_group_count")
    return {
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
        "num_key_value_heads": int(need("attention.head_count")),
        "n_routed_experts": int(need("expert_count")),
        "kv_lora_rank": int(need("attention.kv_lora_rank")),
        "q_lora_rank": field(f"{arch}.attention.q_lora_rank") or None,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(key_len) - rope,
        "v_head_dim": int(value_len),
        "first_k_dense_replace": int(field(f"{arch}.leading_dense_block_count") or 0),
        "n_shared_experts": int(field(f"{arch}.expert_shared_count") or 0),
        "routed_scaling_factor": float(field(f"{arch}.expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(field(f"{arch}.expert_weights_norm") or False),
        "scoring_func": "sigmoid" if sigmoid else "softmax",
        "topk_method": "noaux_tc" if sigmoid else "group_limited_greedy" if groups else "greedy",
        "n_group": groups,
        "topk_group": field(f"{arch}.expert_group_used_count"),
        "head_dim": None,
    }


def fuse_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """llama.cpp's split MLA up-projection back into HF's kv_b_proj [heads * (nope + v), rank]:
    k_b [heads, rank, nope] (stored transposed for the absorbed product), v_b [heads, v, rank]."""
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, v_b.shape[-1]).contiguous()


def llama_moe_config(field: Callable[[str], Any], arch: str) -> dict[str, Any]:
    """HF config keys of a llama file with experts (Mixtral and its kin): llama.cpp writes
    them as `llama` with expert_count; the experts' size is feed_forward_length."""
    experts = field(f"{arch}.expert_count")
    if not experts:
        raise ModelLoadError(
            "GGUF architecture 'llama' without expert_count is a dense model; hetserve serves "
            "MoE models (Mixtral-style llama files have experts)"
        )
    return {"num_local_experts": int(experts), "sliding_window": None}


def unpermute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's q / k rows for its interleaved rotary (pairs
    i, i + d/2 become 2i, 2i + 1); this is the inverse, back to HF's rotate-half order."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's q / k rows -> llama.cpp's order (what its converter writes for `llama`)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
