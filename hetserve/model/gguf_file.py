"""GGUF files (llama.cpp) of the MoE families we support, read with the `gguf` package.

`GgufCheckpoint` offers what the loader reads from a safetensors checkpoint: an HF-style config
(config.json beside the file wins; else one derived from the GGUF metadata with llama.cpp's
semantics) and a stream of weights under their HF names. Routed experts in q8_0 or q4_K stay in
those numbers, exactly: q8_0 is int8 with an fp16 scale per 32 (`Int8Rows`, cpu-int8), q4_K
stays in its own super-blocks (`Q4KRows`, cpu-int4: 4.5 bits per weight, read as they are by
the native kernel). Every other tensor, and experts of other types, is dequantized by `gguf`
itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from hetserve.errors import ModelLoadError, UnsupportedArchitectureError
from hetserve.quant.gguf import q4_k_rows, q8_0_rows
from hetserve.quant.packed import QMatrix

# GGUF architecture -> (HF architecture, model_type, llama.cpp's norm of the top-k weights)
ARCHITECTURES = {
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", True),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe", False),
}
_LAYER = r"^blk\.(\d+)\."
_MLP = r"model.layers.\1.mlp."
_NAMES = [
    (r"^token_embd\.weight$", "model.embed_tokens.weight"),
    (r"^output_norm\.weight$", "model.norm.weight"),
    (r"^output\.weight$", "lm_head.weight"),
    (_LAYER + r"attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (_LAYER + r"ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (_LAYER + r"attn_(q|k|v)\.(weight|bias)$", r"model.layers.\1.self_attn.\2_proj.\3"),
    (_LAYER + r"attn_output\.weight$", r"model.layers.\1.self_attn.o_proj.weight"),
    (_LAYER + r"attn_(q|k)_norm\.weight$", r"model.layers.\1.self_attn.\2_norm.weight"),
    (_LAYER + r"ffn_gate_inp\.weight$", _MLP + "gate.weight"),
    (_LAYER + r"ffn_gate_inp_shexp\.weight$", _MLP + "shared_expert_gate.weight"),
    (_LAYER + r"ffn_(gate|up|down)_shexp\.weight$", _MLP + r"shared_expert.\2_proj.weight"),
    (_LAYER + r"ffn_(gate|up|down)\.weight$", _MLP + r"\2_proj.weight"),
]
_EXPERTS = re.compile(_LAYER + r"ffn_(gate|up|down)_exps\.weight$")
# Config keys: HF name -> GGUF key suffix (after "<arch>.").
_CONFIG_KEYS = {
    "hidden_size": "embedding_length",
    "num_hidden_layers": "block_count",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "max_position_embeddings": "context_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
}


def _import_gguf():
    try:
        import gguf
    except ImportError:
        raise ModelLoadError(
            "reading a .gguf model needs the gguf package: pip install gguf==0.19.0"
        ) from None
    return gguf


class GgufCheckpoint:
    def __init__(self, path: Path) -> None:
        gguf = _import_gguf()
        self.path, self._gguf = path, gguf
        try:
            self.reader = gguf.GGUFReader(str(path))
        except (ValueError, OSError) as exc:
            raise ModelLoadError(f"{path} is not a readable GGUF file ({exc})") from None
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"GGUF architecture {self.arch!r} is not supported; supported: "
                f"{', '.join(sorted(ARCHITECTURES))}"
            )
        self.tensor_info = {t.name: t for t in self.reader.tensors}
        self.packed_layers = self._packed_layers()

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def hf_config(self) -> dict:
        """config.json for this file's model, as llama.cpp reads the metadata."""
        hf_arch, model_type, norm = ARCHITECTURES[self.arch]
        cfg = {"architectures": [hf_arch], "model_type": model_type, "norm_topk_prob": norm}
        for key, suffix in _CONFIG_KEYS.items():
            value = self.field(f"{self.arch}.{suffix}")
            if value is not None:
                cfg[key] = value
        cfg["vocab_size"] = len(self.field("tokenizer.ggml.tokens", []))
        cfg["tie_word_embeddings"] = "output.weight" not in self.tensor_info
        cfg["eos_token_id"] = self.field("tokenizer.ggml.eos_token_id")
        cfg["bos_token_id"] = self.field("tokenizer.ggml.bos_token_id")
        if model_type == "qwen2_moe":
            cfg["qkv_bias"] = "blk.0.attn_q.bias" in self.tensor_info
        return cfg

    def _packed_layers(self) -> dict[int, str]:
        """Layers whose three expert tensors are all q8_0 or all q4_K -> "int8" / "int4"."""
        q = self._gguf.GGMLQuantizationType
        kinds: dict[int, set] = {}
        for name, t in self.tensor_info.items():
            m = _EXPERTS.match(name)
            if m:
                kinds.setdefault(int(m.group(1)), set()).add(t.tensor_type)
        packed = {}
        for layer, types in kinds.items():
            if types == {q.Q8_0}:
                packed[layer] = "int8"
            elif types == {q.Q4_K}:
                packed[layer] = "int4"
        return packed

    @property
    def packed_fmt(self) -> str | None:
        fmts = set(self.packed_layers.values())
        return None if not fmts else ("int8" if "int8" in fmts else "int4")

    def quantized_names(self) -> set[str]:
        names = set()
        for name, t in self.tensor_info.items():
            m = _EXPERTS.match(name)
            if m and int(m.group(1)) in self.packed_layers:
                prefix = f"model.layers.{m.group(1)}.mlp.experts"
                n = int(t.shape[-1])  # ne[2]: the number of experts
                names.update(f"{prefix}.{e}.{m.group(2)}_proj.weight" for e in range(n))
        return names

    def nbytes(self) -> int:
        return sum(int(t.n_bytes) for t in self.reader.tensors)

    def _value(self, t, packed: bool):
        q = self._gguf.GGMLQuantizationType
        if packed and t.tensor_type == q.Q8_0:
            return q8_0_rows(t.data)
        if packed and t.tensor_type == q.Q4_K:
            return q4_k_rows(t.data)
        if t.tensor_type in (q.F32, q.F16):
            return torch.from_numpy(np.array(t.data, dtype=np.float32))
        if t.tensor_type == q.BF16:
            raw = np.ascontiguousarray(t.data).view(np.int16)
            return torch.from_numpy(raw.copy()).view(torch.bfloat16).float()
        shape = tuple(int(d) for d in reversed(t.shape))
        deq = self._gguf.quants.dequantize(t.data, t.tensor_type)
        return torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32).reshape(shape))

    def tensors(self, wanted: Callable[[str], bool]) -> Iterator[tuple[str, object, int]]:
        for name, t in self.tensor_info.items():
            m = _EXPERTS.match(name)
            if m:
                layer = int(m.group(1))
                prefix = f"model.layers.{layer}.mlp.experts"
                stacked = self._value(t, layer in self.packed_layers)
                n = int(t.shape[-1])
                for e in range(n):
                    hf = f"{prefix}.{e}.{m.group(2)}_proj.weight"
                    if wanted(hf):
                        sel = stacked.select(e) if isinstance(stacked, QMatrix) else stacked[e]
                        yield hf, sel, int(t.n_bytes) // n
                continue
            hf = self._hf_name(name)
            if wanted(hf):
                # q8_0 / q4_K matrices as they are (the filler dequantizes them, and keeps them
                # for linears that a placement may serve quantized)
                yield hf, self._value(t, len(t.shape) == 2), int(t.n_bytes)

    def _hf_name(self, name: str) -> str:
        for pattern, repl in _NAMES:
            if re.match(pattern, name):
                return re.sub(pattern, repl, name)
        raise ModelLoadError(
            f"GGUF tensor {name!r} ({self.arch}) has no counterpart in hetserve's model; the "
            "file holds something this loader does not read"
        )


# Byte-level BPE pre-tokenizers by `tokenizer.ggml.pre` (the split before BPE merges).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("gpt-2", "default", "qwen2")


def gguf_tokenizer(ckpt: GgufCheckpoint):
    """The `tokenizers` Tokenizer a GGUF file describes (byte-level BPE, "gpt2" model)."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    kind, pre = ckpt.field("tokenizer.ggml.model"), ckpt.field("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"GGUF tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported (supported: "
            f"gpt2 with {', '.join(PRE_TOKENIZERS)}); put a tokenizer.json beside the file"
        )
    tokens = ckpt.field("tokenizer.ggml.tokens")
    types = ckpt.field("tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens) if t}
    merges = [tuple(m.split(" ", 1)) for m in ckpt.field("tokenizer.ggml.merges", [])]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre != "qwen2")
    if pre == "qwen2":
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types, strict=True) if t and ty in (3, 4)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok
