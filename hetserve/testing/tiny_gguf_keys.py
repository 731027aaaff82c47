"""The metadata keys and vocabulary of testing/tiny_gguf_archs.py's files, as llama.cpp's
converter (convert_hf_to_gguf.py) writes them per family: the common keys, gpt-oss's YaRN and
sliding window, the Qwen3-Next / Qwen3.5 linear-attention sizes, MiniMax-M2's, DeepSeek-V3 /
V3.2's MLA and indexer sizes, Kimi-Linear's per-layer heads, the Qwen2/3-MoE and Mixtral
expert sizes; and a Kimi-format (tiktoken) tokenizer as llama.cpp's gpt2 tokens and merges.
Who calls it: tiny_gguf (Qwen-MoE, Mixtral), tiny_gguf_archs and random_gguf (the 30B-shaped
Qwen3-MoE and gpt-oss files). Held against the converter's own files by
tests/model/test_gguf_archs.py where llama.cpp's source is present.
"""

from __future__ import annotations

import json
from pathlib import Path


def gguf_metadata(writer, arch: str, cfg: dict) -> None:
    """The model's keys as llama.cpp's converter writes them for `arch` (config.json `cfg`)."""
    import gguf

    rope = cfg.get("rope_parameters") or {}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg.get("max_position_embeddings") or cfg["model_max_length"])
    writer.add_embedding_length(cfg["hidden_size"])
    qwen_moe = arch in ("qwen2moe", "qwen3moe", "llama")  # llama: Mixtral's GGUF arch
    if cfg.get("intermediate_size") or qwen_moe:  # the Qwen-MoE converters write 0 if absent
        writer.add_feed_forward_length(cfg.get("intermediate_size") or 0)
    writer.add_head_count(cfg["num_attention_heads"])
    mla = arch in (
        "deepseek2",
        "deepseek32",
    )  # MLA: one latent "head" of kv_lora_rank (+ the rotary part)
    kimi = arch == "kimi-linear"  # these three per layer / its own way: _kimi_metadata
    if not kimi:
        writer.add_head_count_kv(1 if mla else cfg["num_key_value_heads"])
    writer.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_expert_count(
        cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg["num_local_experts"]
    )
    writer.add_expert_used_count(cfg.get("num_experts_per_tok") or cfg["num_experts_per_token"])
    rank = cfg.get("kv_lora_rank") or 0
    if not kimi:
        writer.add_key_length(rank + cfg["qk_rope_head_dim"] if mla else head_dim)
        writer.add_value_length(rank if mla else head_dim)
    if qwen_moe:
        if cfg.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        return
    if arch == "gpt-oss":
        if rope.get("rope_type") == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rope["factor"])
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        writer.add_sliding_window(cfg["sliding_window"])
        writer.add_expert_feed_forward_length(cfg["intermediate_size"])
        return
    if mla:
        _deepseek_metadata(writer, arch, cfg)
        return
    if arch == "kimi-linear":
        _kimi_metadata(writer, cfg)
        return
    if arch == "minimax-m2":
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_feed_forward_length(cfg["intermediate_size"])
        writer.add_rope_dimension_count(cfg["rotary_dim"])
        return
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    writer.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(cfg["linear_key_head_dim"])
    writer.add_ssm_group_count(cfg["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    writer.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    every = cfg.get("full_attention_interval", 4)
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "linear_attention"
        for i in range(cfg["num_hidden_layers"])
    ]
    # the key llama.cpp reads (newer than the pinned gguf package's writer methods)
    writer.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in types])
    writer.add_full_attention_interval(every)
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    writer.add_rope_dimension_count(int(head_dim * partial))
    if arch == "qwen35moe":
        writer.add_rope_dimension_sections([*rope.get("mrope_section", [11, 11, 10]), 0][:4])


def _deepseek_metadata(writer, a: str, cfg: dict) -> None:
    """The DeepSeek-V3 (deepseek2) and V3.2 (deepseek32) keys past the common ones (key names
    as llama.cpp reads them; some are newer than the pinned gguf package's writer methods)."""
    rope = cfg["rope_parameters"]
    rank, rope_dim = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    ints = {
        "expert_group_count": cfg["n_group"], "expert_group_used_count": cfg["topk_group"],
        "leading_dense_block_count": cfg["first_k_dense_replace"],
        "vocab_size": cfg["vocab_size"], "attention.q_lora_rank": cfg["q_lora_rank"],
        "attention.kv_lora_rank": rank,
        "attention.key_length_mla": cfg["qk_nope_head_dim"] + rope_dim,
        "attention.value_length_mla": cfg["v_head_dim"],
        "expert_feed_forward_length": cfg["moe_intermediate_size"],
        "expert_shared_count": cfg["n_shared_experts"], "rope.dimension_count": rope_dim,
    }  # fmt: skip
    if a == "deepseek32":
        ints.update({
            "nextn_predict_layers": cfg.get("num_nextn_predict_layers", 0),
            "attention.indexer.head_count": cfg["index_n_heads"],
            "attention.indexer.key_length": cfg["index_head_dim"],
            "attention.indexer.top_k": cfg["index_topk"],
        })  # fmt: skip
    else:  # V3: sigmoid routing with a bias
        ints["expert_gating_func"] = 2
    for key, value in ints.items():
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_string(f"{a}.rope.scaling.type", "yarn")
    floats = {
        "rope.scaling.factor": rope["factor"], "rope.scaling.yarn_beta_fast": rope["beta_fast"],
        "rope.scaling.yarn_beta_slow": rope["beta_slow"],
        "expert_weights_scale": cfg["routed_scaling_factor"],
        "rope.scaling.yarn_log_multiplier": 0.1 * rope["mscale_all_dim"],
    }  # fmt: skip
    for key, value in floats.items():
        writer.add_float32(f"{a}.{key}", value)
    writer.add_uint32(f"{a}.rope.scaling.original_context_length",
                      rope["original_max_position_embeddings"])  # fmt: skip
    writer.add_bool(f"{a}.expert_weights_norm", bool(cfg["norm_topk_prob"]))


def _kimi_metadata(writer, cfg: dict) -> None:
    """Kimi-Linear's keys: per-layer key-value heads (0 for KDA layers, MLA's one latent head
    for the full-attention ones), the KDA sizes, MLA's (no q LoRA), DeepSeek-V3's routing."""
    a, lin = "kimi-linear", cfg["linear_attn_config"]
    rank, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    full = set(lin["full_attn_layers"])  # 1-based
    kv = [1 if i + 1 in full else 0 for i in range(cfg["num_hidden_layers"])]
    writer.add_array(f"{a}.attention.head_count_kv", kv)
    ints = {
        "attention.key_length": rank + rope,
        # the converter's value_length: transformers' KimiLinearConfig.head_dim (the rope
        # dim); llama.cpp and hetserve read value_length_mla
        "attention.value_length": rope,
        "expert_group_used_count": cfg.get("topk_group", 1), "expert_gating_func": 2,
        "vocab_size": cfg["vocab_size"], "ssm.conv_kernel": lin["short_conv_kernel_size"],
        "kda.head_dim": lin["head_dim"], "attention.kv_lora_rank": rank,
        "rope.dimension_count": rope,
        "attention.key_length_mla": cfg["qk_nope_head_dim"] + rope,
        "attention.value_length_mla": cfg["v_head_dim"],
        "expert_feed_forward_length": cfg["moe_intermediate_size"],
        "expert_shared_count": cfg["num_shared_experts"],
        "leading_dense_block_count": cfg["first_k_dense_replace"],
    }  # fmt: skip
    for key, value in ints.items():
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_float32(f"{a}.expert_weights_scale", cfg["routed_scaling_factor"])


def _bpe_parts(ranks: dict[bytes, int], token: bytes) -> list[bytes]:
    """`token` split by byte-pair merges of rank below its own: the last merge's two halves."""
    parts = [token[i : i + 1] for i in range(len(token))]
    limit = ranks[token]
    while len(parts) > 2:
        pairs = [(ranks.get(parts[i] + parts[i + 1], limit), i) for i in range(len(parts) - 1)]
        rank, i = min(pairs)
        if rank >= limit:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def tiktoken_vocab(writer, src: Path, cfg: dict) -> None:
    """A Kimi-format tokenizer (tiktoken.model ranks, specials in tokenizer_config.json) as
    llama.cpp's gpt2 vocab keys: byte-level token strings, the merges that rebuild each token,
    specials as control tokens and unused ids as [PADi]."""
    import base64

    from hetserve.model.tiktoken_tokenizer import BYTE_LEVEL_CHARS

    def text(b: bytes) -> str:
        return "".join(BYTE_LEVEL_CHARS[x] for x in b)

    ranks = {}
    for line in (src / "tiktoken.model").read_text().splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    specials = {int(i): t["content"] for i, t in tok_cfg.get("added_tokens_decoder", {}).items()}
    by_id = {r: text(b) for b, r in ranks.items()}
    tokens = [specials.get(i) or by_id.get(i) or f"[PAD{i}]" for i in range(cfg["vocab_size"])]
    types = [3 if i in specials else 1 if i in by_id else 5 for i in range(cfg["vocab_size"])]
    merges = []
    for b, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        parts = _bpe_parts(ranks, b) if len(b) > 1 else []
        if len(parts) == 2:
            merges.append(f"{text(parts[0])} {text(parts[1])}")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token_id", writer.add_bos_token_id),
                     ("eos_token_id", writer.add_eos_token_id)):  # fmt: skip
        if cfg.get(key) is not None:
            add(cfg[key])
