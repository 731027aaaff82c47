"""Tiny random checkpoints of the real architectures, written in the HF on-disk format.

Used by the tests (transformers loads the same files as the reference) and as the demo model.
Tensors are generated one at a time and written in shards, so multi-GB checkpoints for the
benchmarks need little memory. Weights are scaled by 1/sqrt(fan_in) so activations stay O(1).
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from hetserve import envs
from hetserve.errors import InvalidInputError
from hetserve.model.config import ModelConfig
from hetserve.model.registry import model_class
from hetserve.testing.chat_templates import FAMILY_FORMATS, FORMATS
from hetserve.testing.tiny_tiktoken import MODEL_VOCAB_SIZE as KIMI_VOCAB_SIZE
from hetserve.testing.tiny_tiktoken import write_kimi_tokenizer
from hetserve.testing.tiny_tokenizer import EOS_TOKEN, PAD_TOKEN, write_tokenizer_files

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
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
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
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
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
SHARD_BYTES = 1 << 30
_DROP_IF_NONE = (
    "intermediate_size",
    "n_routed_experts",
    "n_shared_experts",
    "max_position_embeddings",
)


def cache_dir() -> Path:
    return envs.cache_dir()


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


def _init_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, lm_scale: float):
    if name.endswith("A_log"):  # decays of a few percent per token: the state remembers
        return torch.log(0.02 + 0.1 * torch.rand(shape, generator=gen))
    if name.endswith("dt_bias"):
        return 0.5 * torch.randn(shape, generator=gen)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(".bias") or name.endswith("e_score_correction_bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=gen)
    scale = lm_scale if name == "lm_head.weight" else 1.0
    return torch.randn(shape, generator=gen) * (scale / math.sqrt(shape[-1]))


def _checkpoint_tensors(model, layout: str):
    """(checkpoint name, shape) in HF layout; routed experts per expert or fused."""
    custom = getattr(model, "hf_checkpoint_shapes", None)  # families with their own layout
    if custom is not None:
        yield from ((name, shape, None) for name, shape in custom())
        return
    names = model.expert_weight_names
    for name, p in model.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".experts") and leaf in ("w13", "w2"):
            e, two_i, h = p.shape if leaf == "w13" else (p.shape[0], 0, 0)
            if layout == "fused":
                fused = "gate_up_proj" if leaf == "w13" else "down_proj"
                yield model.published_name(f"{prefix}.{fused}"), tuple(p.shape), (leaf, None)
                continue
            for x in range(p.shape[0]):
                if leaf == "w13":
                    for half, n in ((0, names[0]), (1, names[1])):
                        yield f"{prefix}.{x}.{n}.weight", (two_i // 2, h), (leaf, (x, half))
                else:
                    yield f"{prefix}.{x}.{names[2]}.weight", tuple(p.shape[1:]), (leaf, (x, None))
        elif not (model.config.tie_word_embeddings and name == "lm_head.weight"):
            yield model.published_name(name), tuple(p.shape), None


def make_tiny_checkpoint(
    family: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    overrides: dict | None = None,
    layout: str = "per-expert",
    lm_head_scale: float = 1.0,
    vocab_size: int = 512,
    progress: bool = False,
) -> Path:
    """Write config.json, *.safetensors, tokenizer files and generation_config.json to out_dir."""
    if layout not in ("per-expert", "fused"):
        raise InvalidInputError(f"layout must be 'per-expert' or 'fused', got {layout!r}")
    tiny_config(family, 0, overrides)  # validates the family before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chat = FORMATS[FAMILY_FORMATS[family]]
    tok = write_tokenizer_files(out, cache_dir(), vocab_size, chat)
    cfg = tiny_config(family, tok.get_vocab_size(), overrides)
    eos_ids = [tok.token_to_id(t) for t in chat.eos or (EOS_TOKEN,)]
    bos_id = tok.token_to_id(chat.bos) if chat.bos else None
    cfg.update(
        eos_token_id=eos_ids[0], pad_token_id=tok.token_to_id(PAD_TOKEN), bos_token_id=bos_id
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    with torch.device("meta"):
        model = model_class(cfg["architectures"][0])(ModelConfig.from_dict(cfg))
    gen = torch.Generator().manual_seed(seed)
    entries = list(_checkpoint_tensors(model, layout))
    _write_shards(out, entries, gen, lm_head_scale, progress)
    if family in KIMI_TOKENIZER:  # Kimi publishes a tiktoken-format tokenizer, no tokenizer.json
        write_kimi_tokenizer(out, cache_dir())
    return out


def _write_shards(out: Path, entries, gen, lm_scale: float, progress: bool) -> None:
    total = sum(math.prod(shape) * 4 for _, shape, _ in entries)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for old in out.glob("*.safetensors"):
        old.unlink()
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="writing", disable=not progress)
    files, weight_map = [], {}
    for name, shape, _ in entries:
        t = _init_tensor(name, shape, gen, lm_scale).float().contiguous()
        if size and size + t.nbytes > SHARD_BYTES:
            files.append(_flush(out, shards[-1], len(files)))
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
        bar.update(t.nbytes)
    files.append(_flush(out, shards[-1], len(files)))
    bar.close()
    if len(files) == 1:
        os.replace(out / files[0][0], out / "model.safetensors")
        return
    n = len(files)
    for i, (fname, names) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(out / fname, out / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _flush(out: Path, shard: dict, i: int) -> tuple[str, list[str]]:
    fname = f"shard-{i}.tmp.safetensors"
    save_file(shard, str(out / fname), metadata={"format": "pt"})
    names = list(shard)
    shard.clear()
    return fname, names


def demo_model_dir() -> Path:
    """The embedded demo model (a Qwen3-MoE shape), built once under the cache directory."""
    path = cache_dir() / "demo-qwen3-moe-v2"
    if (path / "config.json").is_file():
        return path
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_checkpoint(DEMO_FAMILY, tmp, overrides=DEMO_OVERRIDES, lm_head_scale=4.0)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path
