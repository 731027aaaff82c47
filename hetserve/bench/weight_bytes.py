"""The weight bytes a decoded token reads, from a model's config.json alone: the benchmarks'
bandwidth rooflines (`bench decode`, its `--streams` steps, `bench hybrid`, `bench prefill`'s
arithmetic) divide by these. Pure: no I/O; a config without a key it needs raises KeyError
(the benches read configs of the families they load)."""

from __future__ import annotations


def moe_layer_count(cfg: dict) -> int:
    """Layers whose MLP is a routed-experts block, by each family's config keys."""
    n = cfg["num_hidden_layers"]
    if "n_routed_experts" in cfg:  # DeepSeek: dense first k layers, then every moe_layer_freq
        k, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
        return sum(1 for i in range(n) if i >= k and i % freq == 0)
    if "num_local_experts" in cfg:  # Mixtral: every layer
        return n
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
    return sum(1 for i in range(n) if i not in dense and (i + 1) % step == 0)


def expert_bytes_int8(hidden: int, inter: int) -> int:
    """One routed expert in the cpu-int8 format: gate, up, down as int8 plus fp32 scales per
    output channel (2 * inter for gate+up, hidden for down)."""
    return 3 * hidden * inter + (2 * inter + hidden) * 4


def expert_bytes_per_token(cfg: dict) -> dict[str, int]:
    """Routed-expert weight bytes one decoded token streams: top_k experts in each MoE layer.
    Exact at one token (every selected expert is read once, none shared with another token)."""
    hidden = cfg["hidden_size"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    top_k = cfg["num_experts_per_tok"]
    layers = moe_layer_count(cfg)
    per_expert = expert_bytes_int8(hidden, inter)
    return {
        "moe_layers": layers,
        "top_k": top_k,
        "expert_bytes": per_expert,
        "bytes_per_token": top_k * per_expert * layers,
    }


def dense_bytes_per_token_fp32(cfg: dict) -> int | None:
    """fp32 bytes of the weights every token reads besides routed experts (attention q/k/v/o,
    router, shared experts, lm_head; norms are noise): on a CPU-only machine the "accelerator"
    part streams these too. None for MLA attention (DeepSeek), whose shapes this does not model."""
    if "kv_lora_rank" in cfg:
        return None
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg.get("num_key_value_heads", 1) * hd
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    moe = moe_layer_count(cfg)
    shared_inter = cfg.get("shared_expert_intermediate_size") or 0
    shared = 3 * h * shared_inter + h if shared_inter else 0  # Qwen2-MoE: + its sigmoid gate
    dense_mlp = 3 * h * cfg.get("intermediate_size", 0)
    params = layers * (2 * h * q + 2 * h * kv) + moe * (h * experts + shared)
    params += (layers - moe) * dense_mlp + cfg["vocab_size"] * h
    return 4 * params
