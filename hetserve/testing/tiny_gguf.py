"""Tiny GGUF files as llama.cpp writes them (tensor names, ggml shapes, metadata keys, the
tokenizer inside), from a tiny Qwen3-MoE / Qwen2-MoE checkpoint (testing/tiny.py); routed experts
in q4_K or q8_0, the rest f32 or q8_0. q2_K-q6_K are quantized here (the `gguf` package only
reads them), q8_0 and q5_0 by `gguf` itself, every other GGML type (IQ4_XS, IQ3_S, IQ2_XS, ...)
by llama.cpp's quantizer (testing/ggml_quant.py) where llama-cpp-python is installed; or, as
`random_iq2_xxs` and so on, random valid blocks of a grid i-quant (a model of their own
numbers, which the reference then holds).

`write_gguf` also writes the reference: an fp32 HF directory of what `gguf` dequantizes each
tensor of the written file to, so tests hold hetserve's GGUF reader against gguf's.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from hetserve.errors import InvalidInputError
from hetserve.model.gguf_archs import permute_rope, unpermute_rope
from hetserve.model.st_file import save_safetensors
from hetserve.quant.gguf import quantize_q4_k
from hetserve.testing.tiny_gguf_keys import gguf_metadata

__all__ = ["quantize_q4_k", "write_gguf"]

# HF -> GGUF tensor names that every family's converter shares (tiny_gguf_archs.py builds on
# them too); post_attention_layernorm is ffn_norm to qwen2moe / qwen3moe / llama and
# post_attention_norm to the newer families, so each module adds its own rows.
HF_TO_GGUF_BASE = [
    (r"^model\.embed_tokens\.weight$", "token_embd.weight"),
    (r"^model\.norm\.weight$", "output_norm.weight"),
    (r"^lm_head\.weight$", "output.weight"),
    (r"^model\.layers\.(\d+)\.input_layernorm\.weight$", r"blk.\1.attn_norm.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.(weight|bias)$", r"blk.\1.attn_\2.\3"),
    (r"^model\.layers\.(\d+)\.self_attn\.(q|k)_norm\.weight$", r"blk.\1.attn_\2_norm.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.shared_expert_gate\.weight$",
     r"blk.\1.ffn_gate_inp_shexp.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.shared_expert\.(gate|up|down)_proj\.weight$",
     r"blk.\1.ffn_\2_shexp.weight"),
]  # fmt: skip
_HF_TO_GGUF = [
    *HF_TO_GGUF_BASE,
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.weight$", r"blk.\1.ffn_norm.weight"),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.weight$", r"blk.\1.attn_output.weight"),
    (r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.gate\.weight$",
     r"blk.\1.ffn_gate_inp.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$", r"blk.\1.ffn_\2.weight"),
]  # fmt: skip
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate|up|down|w1|w3|w2)"
    r"(?:_proj)?\.weight$"
)
_PROJ = {"w1": "gate", "w3": "up", "w2": "down"}
# Mixtral is `llama` with experts to llama.cpp (q / k rows reordered for its rotary)
_ARCH = {"Qwen3MoeForCausalLM": "qwen3moe", "Qwen2MoeForCausalLM": "qwen2moe",
         "MixtralForCausalLM": "llama"}  # fmt: skip
_ROPE = re.compile(r"^blk\.\d+\.attn_(q|k)\.weight$")


def _quantize(gguf, w: np.ndarray, kind: str) -> tuple[np.ndarray, object]:
    q = gguf.GGMLQuantizationType
    if kind == "f32":
        return w.astype(np.float32), q.F32
    if kind in ("q8_0", "q5_0"):  # gguf quantizes these itself
        qtype = q.Q8_0 if kind == "q8_0" else q.Q5_0
        return gguf.quants.quantize(w.astype(np.float32), qtype), qtype
    if kind == "q4_K":
        return quantize_q4_k(w.reshape(-1, w.shape[-1])).reshape(*w.shape[:-1], -1), q.Q4_K
    if kind in ("q6_K", "q5_K", "q3_K", "q2_K"):
        from hetserve.testing import gguf_quants

        fn, qtype = getattr(gguf_quants, f"quantize_{kind.lower()}"), q[kind.upper()]
        return fn(w.reshape(-1, w.shape[-1])).reshape(*w.shape[:-1], -1), qtype
    if kind.startswith("random_"):  # valid blocks of a grid i-quant, not w's (a test's own model)
        from hetserve.testing.gguf_quants import random_iq_grid

        name, flat = kind.removeprefix("random_").upper(), w.reshape(-1, w.shape[-1])
        seed = int(np.abs(flat).sum() * 1e4) % (1 << 32)
        raw = random_iq_grid(name, flat.shape[0], flat.shape[1], seed)
        return raw.reshape(*w.shape[:-1], -1), q[name]
    if kind.upper() in gguf.GGMLQuantizationType.__members__:  # llama.cpp's own quantizer
        from hetserve.testing.ggml_quant import ggml_quantize

        return ggml_quantize(w, kind.upper()), gguf.GGMLQuantizationType[kind.upper()]
    raise InvalidInputError(f"no GGML tensor type {kind!r}")


def _gguf_name(name: str) -> str:
    for pattern, repl in _HF_TO_GGUF:
        if re.match(pattern, name):
            return re.sub(pattern, repl, name)
    raise InvalidInputError(f"no GGUF name for {name!r}")


def _tensors(src: Path, cfg: dict) -> dict[str, np.ndarray]:
    """GGUF name -> numpy array; routed experts stacked per layer and projection."""
    out, experts = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        m = _EXPERT.match(name)
        if m:
            proj = _PROJ.get(m.group(3), m.group(3))
            experts.setdefault((int(m.group(1)), proj), {})[int(m.group(2))] = t
        else:
            out[_gguf_name(name)] = t.float().numpy()
    for (layer, proj), per in experts.items():
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = torch.stack(
            [per[e] for e in range(len(per))]
        ).numpy()
    return out


def write_tokenizer(writer, cfg: dict, tok: dict) -> None:
    """A tiny byte-level BPE tokenizer (tokenizer.json `tok`) as llama.cpp's gpt2 vocab keys."""
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    tokens += [""] * (cfg["vocab_size"] - len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # the byte-level split of the tiny tokenizers
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    merges = tok["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_eos_token_id(cfg["eos_token_id"])


def write_gguf(
    src: str | Path,
    out: str | Path,
    reference: str | Path,
    experts: str = "q4_K",
    others: str = "f32",
    down: str | None = None,
    split_max_tensors: int = 0,
) -> Path:
    """`src` (tiny fp32 Qwen-MoE checkpoint) as the GGUF file `out`; the fp32 model that gguf
    reads from it into the directory `reference`. `down`: another type for ffn_down_exps (as
    llama.cpp's Q4_K_M gives some layers q6_K there). `split_max_tensors`: write the model as
    parts `out-0000i-of-0000n.gguf` of at most that many tensors (returns the first)."""
    import gguf

    src, out, reference = Path(src), Path(out), Path(reference)
    cfg = json.loads((src / "config.json").read_text())
    arch = _ARCH.get(cfg["architectures"][0])
    if arch is None:
        raise InvalidInputError(f"no GGUF writer for {cfg['architectures'][0]}")
    writer = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    gguf_metadata(writer, arch, cfg)
    write_tokenizer(writer, cfg, json.loads((src / "tokenizer.json").read_text()))
    ref = {}
    for name, w in _tensors(src, cfg).items():
        kind = experts if "_exps." in name else (others if w.ndim == 2 else "f32")
        kind = down if down and "ffn_down_exps" in name else kind
        heads = _rope_heads(arch, name, cfg)
        if heads:
            w = permute_rope(torch.from_numpy(w), heads).numpy()
        data, qtype = _quantize(gguf, w, kind)
        writer.add_tensor(name, data, raw_dtype=qtype)
        ref[name] = gguf.quants.dequantize(data, qtype).reshape(w.shape)
        if heads:  # the reference in HF's order
            ref[name] = unpermute_rope(torch.from_numpy(np.array(ref[name])), heads).numpy()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _write_reference(src, reference, ref)
    if split_max_tensors:
        return writer.format_shard_names(out)[0]
    return out


def _rope_heads(arch: str, name: str, cfg: dict) -> int:
    """The heads llama.cpp's converter reorders `name`'s rows by (0: none)."""
    m = _ROPE.match(name) if arch == "llama" else None
    if m is None:
        return 0
    return cfg["num_key_value_heads"] if m.group(1) == "k" else cfg["num_attention_heads"]


def _write_reference(src: Path, reference: Path, tensors: dict[str, np.ndarray]) -> None:
    reference.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, reference / f.name)
    hf = {}
    names = load_file(str(src / "model.safetensors")).keys()
    for name in names:
        m = _EXPERT.match(name)
        if m:
            proj = _PROJ.get(m.group(3), m.group(3))
            stacked = tensors[f"blk.{m.group(1)}.ffn_{proj}_exps.weight"]
            hf[name] = torch.from_numpy(np.ascontiguousarray(stacked[int(m.group(2))]))
        else:
            hf[name] = torch.from_numpy(np.ascontiguousarray(tensors[_gguf_name(name)]))
    save_safetensors(hf, str(reference / "model.safetensors"), metadata={"format": "pt"})
