"""What differs per GGUF architecture beyond the Qwen-MoE defaults: llama.cpp's tensor names
for the family's own modules, its metadata keys as an HF config, and tensors llama.cpp's
converter splits that the HF layout keeps whole.

Who calls it: `GgufCheckpoint` (model/gguf_file.py). Pure mapping, no I/O; a key the config
needs that the file lacks is a ModelLoadError naming it.
"""

from __future__ import annotations

import re
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
# deepseek32 (DeepSeek-V3.2): deepseek2's tensors and the sparse-attention indexer's.
_IDX = r"model.layers.\1.self_attn.indexer."
DEEPSEEK32_NAMES = [
    (_L + r"indexer\.k_norm\.(weight|bias)$", _IDX + r"k_norm.\2"),
    (_L + r"indexer\.proj\.weight$", _IDX + "weights_proj.weight"),
    (_L + r"indexer\.attn_k\.weight$", _IDX + "wk.weight"),
    (_L + r"indexer\.attn_q_b\.weight$", _IDX + "wq_b.weight"),
    *DEEPSEEK2_NAMES,
]


# glm4moe (GLM-4.5 / 4.6): DeepSeek's MoE layout (shared experts, router bias), its own norm name.
GLM4MOE_NAMES = [
    (_L + r"post_attention_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    *DEEPSEEK2_NAMES[-2:],
]


# gpt-oss: biases on q / k / v / o and the router, per-head sink logits, its post-attention norm.
GPT_OSS_NAMES = [
    GLM4MOE_NAMES[0],
    (_L + r"attn_output\.bias$", _ATTN + "o_proj.bias"),
    (_L + r"attn_sinks\.weight$", _ATTN + "sinks"),
    (_L + r"ffn_gate_inp\.bias$", _MLP + "gate.bias"),
]


# minimax-m2: the router's correction bias (DeepSeek-V3's name), the rest as the defaults.
MINIMAX_M2_NAMES = [DEEPSEEK2_NAMES[-1]]


def minimax_m2_config(field: Callable[[str], Any], arch: str, tensors: set[str]) -> dict[str, Any]:
    """HF config keys of a minimax-m2 file: partial rotary as rope.dimension_count (MiniMax's
    `rotary_dim`), q / k norms over all heads together, sigmoid routing with a bias."""
    return {
        "num_local_experts": field(f"{arch}.expert_count"),
        "intermediate_size": field(f"{arch}.expert_feed_forward_length"),
        "rotary_dim": field(f"{arch}.rope.dimension_count"),
        "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors,
        "qk_norm_type": "per_layer",
        "scoring_func": "sigmoid"
        if int(field(f"{arch}.expert_gating_func") or 2) == 2
        else "softmax",
        "use_routing_bias": "blk.0.exp_probs_b.bias" in tensors,
    }


def gpt_oss_config(field: Callable[[str], Any], arch: str, tensors: set[str]) -> dict[str, Any]:
    """HF config keys of a gpt-oss file. llama.cpp fixes what the file does not say: the
    clamped SwiGLU's alpha 1.702 and limit 7.0 (gpt-oss's published values), sliding-window
    attention on even layers; YaRN as the published config has it (no truncation of the
    correction range: `truncate` false)."""
    layers = int(field(f"{arch}.block_count") or 0)
    theta = float(field(f"{arch}.rope.freq_base") or 10000.0)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    yarn = yarn_rope(field, arch)
    if yarn:
        rope = {**yarn, "truncate": False}
    return {
        "num_local_experts": field(f"{arch}.expert_count"),
        "intermediate_size": field(f"{arch}.expert_feed_forward_length"),
        "sliding_window": field(f"{arch}.attention.sliding_window"),
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],  # fmt: skip
        "rope_parameters": rope,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }


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
            raise ModelLoadError(f"GGUF {arch} file lacks metadata key {arch}.{key}")
        return value

    rope = int(need("rope.dimension_count"))
    key_len = field(f"{arch}.attention.key_length_mla") or need("attention.key_length")
    value_len = field(f"{arch}.attention.value_length_mla") or need("attention.value_length")
    gating = field(f"{arch}.expert_gating_func")  # V3.2's converter leaves it out: sigmoid
    sigmoid = int(gating) == 2 if gating is not None else arch == "deepseek32"
    groups = field(f"{arch}.expert_group_count")
    cfg = {
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
    rope_scaling = yarn_rope(field, arch)
    if rope_scaling:
        cfg["rope_parameters"] = rope_scaling
    if arch == "deepseek32":  # DeepSeek-V3.2: the sparse-attention indexer's sizes
        cfg.update(
            architectures=["DeepseekV32ForCausalLM"],
            model_type="deepseek_v32",
            index_n_heads=int(need("attention.indexer.head_count")),
            index_head_dim=int(need("attention.indexer.key_length")),
            index_topk=int(need("attention.indexer.top_k")),
        )
    return cfg


def yarn_rope(field: Callable[[str], Any], arch: str) -> dict[str, Any] | None:
    """HF rope_parameters of a file whose rotary is YaRN (None otherwise). DeepSeek's converter
    writes its attention scaling as yarn_log_multiplier = 0.1 x mscale_all_dim; published
    checkpoints have mscale equal to it."""
    if field(f"{arch}.rope.scaling.type") != "yarn":
        return None
    rope: dict[str, Any] = {
        "rope_type": "yarn",
        "rope_theta": float(field(f"{arch}.rope.freq_base") or 10000.0),
        "factor": float(field(f"{arch}.rope.scaling.factor")),
        "original_max_position_embeddings": int(
            field(f"{arch}.rope.scaling.original_context_length")
        ),
        "beta_fast": float(field(f"{arch}.rope.scaling.yarn_beta_fast") or 32.0),
        "beta_slow": float(field(f"{arch}.rope.scaling.yarn_beta_slow") or 1.0),
    }
    log_mul = field(f"{arch}.rope.scaling.yarn_log_multiplier")
    if log_mul:
        rope["mscale"] = rope["mscale_all_dim"] = round(float(log_mul) / 0.1, 6)
    return rope


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


# qwen3next (Qwen3-Next) and qwen35moe (Qwen3.5-MoE): Gated DeltaNet layers' tensors under
# llama.cpp's ssm_* names; their transforms are undone by `linear_attn_value`.
_LIN = r"model.layers.\1.linear_attn."
QWEN3NEXT_NAMES = [
    GLM4MOE_NAMES[0],
    (_L + r"ssm_a$", _LIN + "A_log"),
    (_L + r"ssm_conv1d\.weight$", _LIN + "conv1d.weight"),
    (_L + r"ssm_dt\.bias$", _LIN + "dt_bias"),
    (_L + r"ssm_ba\.weight$", _LIN + "in_proj_ba.weight"),
    (_L + r"ssm_beta\.weight$", _LIN + "in_proj_b.weight"),
    (_L + r"ssm_alpha\.weight$", _LIN + "in_proj_a.weight"),
    (_L + r"ssm_norm\.weight$", _LIN + "norm.weight"),
    (_L + r"ssm_out\.weight$", _LIN + "out_proj.weight"),
    (_L + r"attn_qkv\.weight$", _LIN + "in_proj_qkv.weight"),  # qwen35moe; qwen3next: fused
    (_L + r"attn_gate\.weight$", _LIN + "in_proj_z.weight"),
]
# llama.cpp stores these norms as the scale they apply (1 + w of the zero-centred HF weight)
ZERO_CENTRED_GGUF = re.compile(r"(attn_norm|post_attention_norm|attn_q_norm|attn_k_norm|"
                               r"output_norm)\.weight$")  # fmt: skip


def qwen3next_config(field: Callable[[str], Any], arch: str, tensors: set[str]) -> dict[str, Any]:
    """HF config keys of a qwen3next / qwen35moe file: the linear-attention sizes from llama.cpp's
    ssm.* keys (group_count = key heads, time_step_rank = value heads, state_size = key head
    dim, inner_size = value heads x value head dim), which layers are recurrent, the partial
    rotary from rope.dimension_count, and Qwen3.5's interleaved M-RoPE sections."""

    def need(key: str) -> Any:
        value = field(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF {arch} file lacks metadata key {arch}.{key}")
        return value

    layers = int(need("block_count")) - int(field(f"{arch}.nextn_predict_layers") or 0)
    v_heads = int(need("ssm.time_step_rank"))
    head_dim = int(need("attention.key_length"))
    rope_dim = int(field(f"{arch}.rope.dimension_count") or head_dim // 4)
    partial = rope_dim / head_dim
    theta = float(field(f"{arch}.rope.freq_base") or 10000.0)
    rope: dict[str, Any] = {"rope_type": "default", "partial_rotary_factor": partial,
                            "rope_theta": theta}  # fmt: skip
    sections = field(f"{arch}.rope.dimension_sections")
    if sections:
        rope.update(mrope_section=[int(s) for s in list(sections)[:3]], mrope_interleaved=True)
    recurrent = field(f"{arch}.attention.recurrent_layers")
    cfg: dict[str, Any] = {
        "linear_conv_kernel_dim": int(need("ssm.conv_kernel")),
        "linear_key_head_dim": int(need("ssm.state_size")),
        "linear_num_key_heads": int(need("ssm.group_count")),
        "linear_num_value_heads": v_heads,
        "linear_value_head_dim": int(need("ssm.inner_size")) // v_heads,
        "full_attention_interval": int(field(f"{arch}.full_attention_interval") or 4),
        "partial_rotary_factor": partial,
        "rope_parameters": rope,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [
            i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors
        ],
    }
    if recurrent is not None:
        kinds = list(recurrent)[:layers]  # the MTP layers after them are left out
        cfg["layer_types"] = ["linear_attention" if r else "full_attention" for r in kinds]
    return cfg


def v_heads_grouped(
    t: torch.Tensor, dim: int, k_heads: int, v_heads: int, size: int
) -> torch.Tensor:
    """llama.cpp's converter (Qwen3.5, key heads fewer than value heads) puts value heads in
    tiled order (value head j of every key head, then j + 1) instead of grouped by key head;
    this is the inverse, for `dim` holding v_heads blocks of `size`."""
    if k_heads == v_heads:
        return t
    shape = list(t.shape)
    dim %= len(shape)
    tiled = t.reshape(*shape[:dim], v_heads // k_heads, k_heads, size, *shape[dim + 1 :])
    return tiled.transpose(dim, dim + 1).reshape(shape)


def fuse_qkvz(qkv: torch.Tensor, z: torch.Tensor, k_heads: int, k_dim: int) -> torch.Tensor:
    """Qwen3-Next's in_proj_qkvz [per key head: q, k, v, z] from llama.cpp's attn_qkv [all q;
    all k; all v] and attn_gate [all z]."""
    hidden = qkv.shape[-1]
    q, k, v = qkv.split([k_heads * k_dim, k_heads * k_dim, qkv.shape[0] - 2 * k_heads * k_dim])
    parts = [p.reshape(k_heads, -1, hidden) for p in (q, k, v, z)]
    return torch.cat(parts, dim=1).reshape(-1, hidden)


def linear_attn_value(leaf: str, w: torch.Tensor, sizes: tuple[int, int, int, int]) -> torch.Tensor:
    """A Gated DeltaNet tensor of a qwen35moe / qwen3next file in HF's form. `leaf`: the HF
    parameter (in_proj_qkv, conv1d, ...); sizes: key heads, value heads, key dim, value dim.
    Undone: ssm_a = -exp(A_log), conv1d's squeezed middle dimension, and (where value heads
    outnumber key heads, qwen35moe only: pass equal heads for qwen3next) the tiled order of
    value heads."""
    nk, nv, dk, dv = sizes
    if leaf == "A_log":
        w = torch.log(-w)
    if leaf in ("A_log", "dt_bias", "in_proj_a.weight", "in_proj_b.weight"):
        return v_heads_grouped(w, 0, nk, nv, 1)
    if leaf in ("in_proj_z.weight", "in_proj_qkv.weight", "conv1d.weight"):
        qk = 2 * nk * dk if leaf != "in_proj_z.weight" else 0
        w = torch.cat((w[:qk], v_heads_grouped(w[qk:], 0, nk, nv, dv)))
        return w.unsqueeze(1) if leaf == "conv1d.weight" else w
    if leaf == "out_proj.weight":
        return v_heads_grouped(w, 1, nk, nv, dv)
    return w


# kimi-linear (Kimi-Linear): KDA layers' tensors under llama.cpp's ssm_* names, MLA layers as
# deepseek2's (no q LoRA), DeepSeek-V3's MoE.
_SA = r"model.layers.\1.self_attn."
KIMI_LINEAR_NAMES = [
    (_L + r"ssm_a$", _SA + "A_log"),
    (_L + r"ssm_conv1d_(q|k|v)\.weight$", _SA + r"\2_conv1d.weight"),
    (_L + r"ssm_dt\.bias$", _SA + "dt_bias"),
    (_L + r"ssm_(f|g)_(a|b)\.weight$", _SA + r"\2_\3_proj.weight"),
    (_L + r"ssm_beta\.weight$", _SA + "b_proj.weight"),
    (_L + r"ssm_norm\.weight$", _SA + "o_norm.weight"),
    *DEEPSEEK2_NAMES,
]
KDA_CHANGED = re.compile(r"^blk\.\d+\.(ssm_a|ssm_conv1d_[qkv]\.weight)$")


def kimi_linear_config(field: Callable[[str], Any], arch: str) -> dict[str, Any]:
    """HF (Moonshot) config keys of a kimi-linear file: which layers are KDA (a key-value head
    count of 0 in llama.cpp's per-layer array) and which MLA, the KDA head size, MLA's sizes
    (key_length_mla = nope + rope, no q LoRA), DeepSeek-V3's routing."""

    def need(key: str) -> Any:
        value = field(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF {arch} file lacks metadata key {arch}.{key}")
        return value

    kv = need("attention.head_count_kv")
    kv = list(kv) if isinstance(kv, list | tuple) else [kv] * int(need("block_count"))
    rope = int(need("rope.dimension_count"))
    heads = int(need("attention.head_count"))
    return {
        "num_key_value_heads": heads,
        "head_dim": None,
        "linear_attn_config": {
            "head_dim": int(need("kda.head_dim")),
            "num_heads": heads,
            "short_conv_kernel_size": int(need("ssm.conv_kernel")),
            "kda_layers": [i + 1 for i, n in enumerate(kv) if int(n) == 0],
            "full_attn_layers": [i + 1 for i, n in enumerate(kv) if int(n) > 0],
        },
        "kv_lora_rank": int(need("attention.kv_lora_rank")),
        "q_lora_rank": field(f"{arch}.attention.q_lora_rank") or None,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(need("attention.key_length_mla")) - rope,
        "v_head_dim": int(need("attention.value_length_mla")),
        "mla_use_nope": True,
        "num_experts_per_token": int(need("expert_used_count")),
        "num_shared_experts": int(field(f"{arch}.expert_shared_count") or 0),
        "first_k_dense_replace": int(field(f"{arch}.leading_dense_block_count") or 0),
        "routed_scaling_factor": float(field(f"{arch}.expert_weights_scale") or 1.0),
        "num_expert_group": int(field(f"{arch}.expert_group_count") or 1),
        "topk_group": int(field(f"{arch}.expert_group_used_count") or 1),
        "moe_router_activation_func": (
            "sigmoid" if int(field(f"{arch}.expert_gating_func") or 2) == 2 else "softmax"
        ),
        "moe_renormalize": True,  # llama.cpp renormalises Kimi-Linear's top-k always
    }


def kda_value(name: str, w: torch.Tensor) -> torch.Tensor:
    """A KDA tensor of a kimi-linear file in HF's form: ssm_a = -exp(A_log) undone, the conv
    weights [1, channels, 1, kernel] back to Conv1d's [channels, 1, kernel]."""
    if name.endswith("ssm_a"):  # (llama.cpp's own writer drops the trailing unit dimensions)
        return torch.log(-w).reshape(1, 1, -1, 1)
    return w.reshape(-1, 1, w.shape[-1])
