"""GGUF files of gpt-oss, Qwen3-Next and Qwen3.5-MoE laid out as llama.cpp's converter
(convert_hf_to_gguf.py) lays them out, written from tiny fp32 checkpoints (testing/tiny.py) with
the `gguf` package, so the loader's tests of these families run where llama.cpp's source is
absent. tests/model/test_gguf_archs.py holds each file against the converter's own output
for the same checkpoint wherever that source is present: the same tensor names, types, shapes
and bytes, and the same metadata values the loader reads.

What the converter does that the loader has to undo (model/gguf_archs.py), as it behaves:
  * gpt-oss: the fused, interleaved experts `gate_up_proj` [E, H, 2I] split into gate (even
    columns) and up, each transposed to [E, I, H]; `down_proj` transposed; the biases split the
    same way; MXFP4 experts re-laid as GGML blocks (an e8m0 byte, then elements 0-15 in low
    nibbles and 16-31 in high); `sinks` as attn_sinks.weight.
  * qwen3next / qwen35moe: zero-centred norms stored as 1 + w; A_log as -exp(A_log); the
    conv1d's middle dimension squeezed; Qwen3-Next's in_proj_qkvz (q, k, v, z per key head)
    split into attn_qkv (all q, all k, all v) and attn_gate (all z); Qwen3.5's value heads put in
    tiled order where key heads are fewer.
Types: `linears` (q8_0 or f32) for every matrix but the routers and the conv1d, which stay f32,
as the converter's --outtype does; `experts` may be "mxfp4" (gpt-oss).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from hetserve.errors import InvalidInputError
from hetserve.quant.quantize import quantize_mxfp4
from hetserve.testing.tiny_gguf import HF_TO_GGUF_BASE, write_tokenizer
from hetserve.testing.tiny_gguf_keys import gguf_metadata, tiktoken_vocab

_ARCH = {"GptOssForCausalLM": "gpt-oss", "Qwen3NextForCausalLM": "qwen3next",
         "Qwen3_5MoeForCausalLM": "qwen35moe", "MiniMaxM2ForCausalLM": "minimax-m2",
         "DeepseekV32ForCausalLM": "deepseek32", "DeepseekV3ForCausalLM": "deepseek2",
         "KimiLinearForCausalLM": "kimi-linear"}  # fmt: skip
_COMMON = [
    *HF_TO_GGUF_BASE,
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.weight$",
     r"blk.\1.post_attention_norm.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)$", r"blk.\1.attn_output.\2"),
    (r"^model\.layers\.(\d+)\.self_attn\.sinks$", r"blk.\1.attn_sinks.weight"),
    (r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(?:gate|router)\.(weight|bias)$",
     r"blk.\1.ffn_gate_inp.\2"),
    (r"^model\.layers\.(\d+)\.block_sparse_moe\.e_score_correction_bias$",
     r"blk.\1.exp_probs_b.bias"),
    (r"^model\.layers\.(\d+)\.linear_attn\.A_log$", r"blk.\1.ssm_a"),
    (r"^model\.layers\.(\d+)\.linear_attn\.conv1d\.weight$", r"blk.\1.ssm_conv1d.weight"),
    (r"^model\.layers\.(\d+)\.linear_attn\.dt_bias$", r"blk.\1.ssm_dt.bias"),
    (r"^model\.layers\.(\d+)\.linear_attn\.in_proj_ba\.weight$", r"blk.\1.ssm_ba.weight"),
    (r"^model\.layers\.(\d+)\.linear_attn\.in_proj_b\.weight$", r"blk.\1.ssm_beta.weight"),
    (r"^model\.layers\.(\d+)\.linear_attn\.in_proj_a\.weight$", r"blk.\1.ssm_alpha.weight"),
    (r"^model\.layers\.(\d+)\.linear_attn\.in_proj_qkv\.weight$", r"blk.\1.attn_qkv.weight"),
    (r"^model\.layers\.(\d+)\.linear_attn\.in_proj_z\.weight$", r"blk.\1.attn_gate.weight"),
    (r"^model\.layers\.(\d+)\.linear_attn\.norm\.weight$", r"blk.\1.ssm_norm.weight"),
    (r"^model\.layers\.(\d+)\.linear_attn\.out_proj\.weight$", r"blk.\1.ssm_out.weight"),
    # DeepSeek's MLA, shared experts, router bias and V3.2's indexer
    (r"^model\.layers\.(\d+)\.self_attn\.q_a_proj\.weight$", r"blk.\1.attn_q_a.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.q_a_layernorm\.weight$",
     r"blk.\1.attn_q_a_norm.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.q_b_proj\.weight$", r"blk.\1.attn_q_b.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.kv_a_proj_with_mqa\.weight$",
     r"blk.\1.attn_kv_a_mqa.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.kv_a_layernorm\.weight$",
     r"blk.\1.attn_kv_a_norm.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$",
     r"blk.\1.exp_probs_b.bias"),
    (r"^model\.layers\.(\d+)\.mlp\.shared_experts\.(gate|up|down)_proj\.weight$",
     r"blk.\1.ffn_\2_shexp.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$", r"blk.\1.ffn_\2.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.indexer\.k_norm\.(weight|bias)$",
     r"blk.\1.indexer.k_norm.\2"),
    (r"^model\.layers\.(\d+)\.self_attn\.indexer\.weights_proj\.weight$",
     r"blk.\1.indexer.proj.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.indexer\.wk\.weight$",
     r"blk.\1.indexer.attn_k.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.indexer\.wq_b\.weight$",
     r"blk.\1.indexer.attn_q_b.weight"),
    # Kimi-Linear's KDA layers and its MoE (block_sparse_moe)
    (r"^model\.layers\.(\d+)\.self_attn\.A_log$", r"blk.\1.ssm_a"),
    (r"^model\.layers\.(\d+)\.self_attn\.(q|k|v)_conv1d\.weight$", r"blk.\1.ssm_conv1d_\2.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.dt_bias$", r"blk.\1.ssm_dt.bias"),
    (r"^model\.layers\.(\d+)\.self_attn\.(f|g)_(a|b)_proj\.weight$", r"blk.\1.ssm_\2_\3.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.b_proj\.weight$", r"blk.\1.ssm_beta.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.o_norm\.weight$", r"blk.\1.ssm_norm.weight"),
    (r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.e_score_correction_bias$",
     r"blk.\1.exp_probs_b.bias"),
    (r"^model\.layers\.(\d+)\.block_sparse_moe\.shared_experts\.(gate|up|down)_proj\.weight$",
     r"blk.\1.ffn_\2_shexp.weight"),
]  # fmt: skip
_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")  # fmt: skip
_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up",
         "w2": "down"}  # fmt: skip
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_ZERO_CENTRED = re.compile(r"(input_layernorm|post_attention_layernorm|q_norm|k_norm)\.weight$"
                           r"|^model\.norm\.weight$")  # fmt: skip
_F32_MATRICES = re.compile(
    r"ffn_gate_inp(_shexp)?\.weight$|ssm_conv1d(_[qkv])?\.weight$|indexer\.proj\.weight$"
)


def _name(name: str) -> str:
    for pattern, repl in _COMMON:
        if re.match(pattern, name):
            return re.sub(pattern, repl, name)
    raise InvalidInputError(f"no GGUF name for {name!r}")


def _v_tiled(t: torch.Tensor, dim: int, k_heads: int, v_heads: int, size: int) -> torch.Tensor:
    """Value heads grouped by key head -> tiled (head j of every key head, then j + 1)."""
    shape = list(t.shape)
    grouped = t.reshape(*shape[:dim], k_heads, v_heads // k_heads, size, *shape[dim + 1 :])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def _linear_attn(
    arch: str, leaf: str, w: torch.Tensor, cfg: dict
) -> list[tuple[str, torch.Tensor]]:
    """(GGUF leaf, tensor) for one Gated DeltaNet parameter `leaf` (after linear_attn.)."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    if leaf == "in_proj_qkvz.weight":  # qwen3next: per key head [q, k, v, z]
        hidden = w.shape[-1]
        per = w.reshape(nk, -1, hidden)
        q, k, v, z = per.split([dk, dk, nv // nk * dv, nv // nk * dv], dim=1)
        qkv = torch.cat([p.reshape(-1, hidden) for p in (q, k, v)])
        return [("attn_qkv.weight", qkv), ("attn_gate.weight", z.reshape(-1, hidden))]
    if leaf == "A_log":
        w = -torch.exp(w)
    elif leaf == "conv1d.weight":
        w = w.squeeze()
    tiled = arch == "qwen35moe" and nk != nv
    if tiled and leaf in ("A_log", "dt_bias", "in_proj_a.weight", "in_proj_b.weight"):
        w = _v_tiled(w, 0, nk, nv, 1)
    elif tiled and leaf in ("in_proj_qkv.weight", "in_proj_z.weight", "conv1d.weight"):
        qk = 0 if leaf == "in_proj_z.weight" else 2 * nk * dk
        w = torch.cat((w[:qk], _v_tiled(w[qk:], 0, nk, nv, dv)))
    elif tiled and leaf == "out_proj.weight":
        w = _v_tiled(w, 1, nk, nv, dv)
    return [("", w)]


def _tensors(src: Path, arch: str, cfg: dict) -> dict[str, torch.Tensor]:
    """GGUF name -> fp32 tensor in the converter's layout (torch's [.., rows, cols] order)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        t = t.float()
        m, f = _PER_EXPERT.match(name), _FUSED.match(name)
        if m:
            experts.setdefault((int(m.group(1)), _PROJ[m.group(3)]), {})[int(m.group(2))] = t
        elif f:
            layer, proj, bias = f.groups()
            suffix = "bias" if bias else "weight"
            if not bias:
                t = t.transpose(1, 2)  # [E, out, in]
            if proj == "down_proj":
                out[f"blk.{layer}.ffn_down_exps.{suffix}"] = t
            else:
                out[f"blk.{layer}.ffn_gate_exps.{suffix}"] = t[:, 0::2]
                out[f"blk.{layer}.ffn_up_exps.{suffix}"] = t[:, 1::2]
        elif name.endswith("self_attn.kv_b_proj.weight"):  # split per head, k_b transposed
            layer = name.split(".")[2]
            heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            k_b, v_b = t.view(heads, nope + v, -1).split([nope, v], dim=1)
            out[f"blk.{layer}.attn_k_b.weight"] = k_b.transpose(1, 2)
            out[f"blk.{layer}.attn_v_b.weight"] = v_b
        elif ".linear_attn." in name:
            layer, leaf = re.match(r"^model\.layers\.(\d+)\.linear_attn\.(.+)$", name).groups()  # type: ignore[union-attr]
            for gguf_leaf, w in _linear_attn(arch, leaf, t, cfg):
                out[f"blk.{layer}.{gguf_leaf}" if gguf_leaf else _name(name)] = w
        else:
            gguf_name = _name(name)
            if arch in ("minimax-m2", "deepseek2", "deepseek32", "kimi-linear"):  # older name
                gguf_name = gguf_name.replace("post_attention_norm", "ffn_norm")
            zero_centred = arch in ("qwen3next", "qwen35moe") and _ZERO_CENTRED.search(name)
            if arch == "kimi-linear" and name.endswith("A_log"):  # stored as -exp(A_log)
                t = -torch.exp(t)
            elif arch == "kimi-linear" and "_conv1d." in name:  # [d, 1, k] -> [1, d, 1, k]
                t = t.reshape(1, t.shape[0], 1, t.shape[-1])
            out[gguf_name] = t + 1.0 if zero_centred else t
    for (layer, proj), per in experts.items():
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = torch.stack([per[e] for e in sorted(per)])
    return out


def mxfp4_ggml(w: torch.Tensor) -> np.ndarray:
    """w [.., N, K] -> GGML MXFP4 rows [.., N, K/32 * 17] (quantize_mxfp4's numbers)."""
    blocks, scales = quantize_mxfp4(w)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    raw = torch.cat((scales.unsqueeze(-1), qs), dim=-1)
    return raw.reshape(*raw.shape[:-2], -1).numpy()


def write_family_gguf(
    src: str | Path, out: str | Path, linears: str = "q8_0", experts: str | None = None
) -> Path:
    """`src` (a tiny fp32 gpt-oss / Qwen3-Next / Qwen3.5-MoE checkpoint) as the GGUF file `out`,
    as `convert_hf_to_gguf.py --outtype linears` writes it; `experts`: "mxfp4" for gpt-oss's
    published expert format (else the same type as the linears)."""
    import gguf

    src, out = Path(src), Path(out)
    cfg = json.loads((src / "config.json").read_text())
    arch = _ARCH.get(cfg["architectures"][0])
    if arch is None:
        raise InvalidInputError(f"no GGUF family writer for {cfg['architectures'][0]}")
    writer = gguf.GGUFWriter(str(out), arch)
    gguf_metadata(writer, arch, cfg)
    tok_cfg = src / "tokenizer_config.json"
    template = json.loads(tok_cfg.read_text()).get("chat_template") if tok_cfg.exists() else None
    if (src / "tokenizer.json").exists():
        write_tokenizer(writer, cfg, json.loads((src / "tokenizer.json").read_text()))
    else:  # Kimi's tiktoken format
        tiktoken_vocab(writer, src, cfg)
    if template:
        writer.add_chat_template(template)
    q = gguf.GGMLQuantizationType
    for name, w in _tensors(src, arch, cfg).items():
        if experts == "mxfp4" and name.endswith("_exps.weight"):
            writer.add_tensor(name, mxfp4_ggml(w), raw_dtype=q.MXFP4)
        elif linears != "q8_0" or not name.endswith(".weight") or w.ndim < 2:
            writer.add_tensor(name, np.ascontiguousarray(w.numpy(), dtype=np.float32))
        elif _F32_MATRICES.search(name):
            writer.add_tensor(name, np.ascontiguousarray(w.numpy(), dtype=np.float32))
        elif w.shape[-1] % 32:  # rows that are no whole q8_0 blocks: f16, as the converter does
            writer.add_tensor(name, w.numpy().astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w.numpy(), q.Q8_0), raw_dtype=q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
