"""GGUF files (llama.cpp) of the MoE families we support, read with the `gguf` package.

`GgufCheckpoint` offers what the loader reads from a safetensors checkpoint: an HF-style config
(config.json beside the file wins; else one derived from the GGUF metadata with llama.cpp's
semantics) and a stream of weights under their HF names. Routed experts never widen to fp32:
q8_0, q2_K-q6_K, IQ4_XS and IQ4_NL tensors stay in their numbers, exactly, each tensor
in its own type (a layer may mix them: cpu-gguf; all q4_K: cpu-int4; all q8_0: cpu-int8), and
gpt-oss's MXFP4 experts re-laid, exactly, for cpu-mxfp4 (a layer all MXFP4); other
types are converted at load to the native format of no more bits per weight (q2_K where none
has so few; quant/gguf_convert.py, convert_target), as are gate and up of different types (both to
the target of the smaller: they share one fused matrix). Linears that the placement serves on
the int8 kernel (`tensors`' `int8`: all-int8's attention, shared experts, dense MLPs, lm_head)
go to it per tensor, never as a model-sized fp32 copy: q8_0, the K-quants q2_K-q6_K and the
4-bit i-quants as they are (the token embeddings too: layers/quant_embedding.py), any other
type dequantized one tensor at a time and rounded to int8 in groups of 32 columns with fp16
scales (`Int8Rows.grouped`: |error| <= scale / 2 per weight, scale ~ max|group| / 127), the
fp32 tensor dropped at once. Every other tensor is dequantized by `gguf` itself. `summary()` is
the one line the loader prints of what it did, with each conversion's relative RMS error
against the file's own (dequantized) numbers. What each architecture's converter changed
(names, split or reshaped tensors, values stored transformed) is undone per family with
model/gguf_archs.py's tables and functions; MTP layers appended after the model's are left out.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from hetserve.errors import ModelLoadError, UnsupportedArchitectureError
from hetserve.model.gguf_archs import (
    DEEPSEEK2_NAMES,
    DEEPSEEK32_NAMES,
    GLM4MOE_NAMES,
    GPT_OSS_NAMES,
    KIMI_LINEAR_NAMES,
    MINIMAX_M2_NAMES,
    QWEN3NEXT_NAMES,
    deepseek2_config,
    glm4moe_config,
    gpt_oss_config,
    kimi_linear_config,
    llama_moe_config,
    minimax_m2_config,
    qwen3next_config,
    yarn_rope,
)
from hetserve.model.gguf_family import LINEAR_ATTN, FamilyTensors
from hetserve.model.gguf_parts import open_parts, release_pages
from hetserve.quant.gguf import BITS, KEPT
from hetserve.quant.gguf_convert import NATIVE_BPW, convert_target, converted, relative_rms
from hetserve.quant.packed import Int8Rows, QMatrix

# The types an int8 linear (and the token embeddings) take as they are: the native linear
# kernel reads q8_0's numbers and the K-quants' super-blocks.
LINEARS_KEPT = ("Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL", "IQ2_XXS",
                "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")  # fmt: skip

# GGUF architecture -> (HF architecture, model_type, llama.cpp's norm of the top-k weights)
ARCHITECTURES = {
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe", True),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe", False),
    "deepseek2": ("DeepseekV2ForCausalLM", "deepseek_v2", False),  # gguf_archs: V3 by gating
    "deepseek32": ("DeepseekV32ForCausalLM", "deepseek_v32", True),
    "glm4moe": ("Glm4MoeForCausalLM", "glm4_moe", True),
    "llama": ("MixtralForCausalLM", "mixtral", True),  # llama files with experts (Mixtral)
    "gpt-oss": ("GptOssForCausalLM", "gpt_oss", True),
    "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next", True),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", True),
    "minimax-m2": ("MiniMaxM2ForCausalLM", "minimax_m2", True),
    "kimi-linear": ("KimiLinearForCausalLM", "kimi_linear", True),
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


class GgufCheckpoint(FamilyTensors):
    def __init__(self, path: Path) -> None:
        gguf = _import_gguf()
        self.path, self._gguf = path, gguf
        self.parts = open_parts(gguf, path)  # split models: every part, the first's metadata
        self.reader = self.parts[0]
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"GGUF architecture {self.arch!r} is not supported; supported: "
                f"{', '.join(sorted(ARCHITECTURES))}"
            )
        # MTP (next-token prediction) layers that llama.cpp's converters append after the
        # model's own (GLM-4.5, Qwen3-Next, Qwen3.5): for speculative decoding, not served here
        nextn = int(self.field(f"{self.arch}.nextn_predict_layers") or 0)
        self.num_layers = int(self.field(f"{self.arch}.block_count") or 0) - nextn
        self.tensor_info = {t.name: t for r in self.parts for t in r.tensors
                            if not self._mtp_layer(t.name)}  # fmt: skip
        self.packed_layers, self._convert = self._packed_layers()
        self._done: dict[str, int] = {}  # summary: "what -> how" -> tensors
        self._converted: dict[tuple[str, str], tuple[int, float]] = {}  # -> tensors, worst error
        self._linears: dict[tuple[str, str], tuple[int, float]] = {}  # the same, int8 linears

    def _mtp_layer(self, name: str) -> bool:
        m = re.match(r"^blk\.(\d+)\.", name)
        return m is not None and int(m.group(1)) >= self.num_layers

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
        cfg["num_hidden_layers"] = self.num_layers
        cfg["vocab_size"] = len(self.field("tokenizer.ggml.tokens", []))
        cfg["tie_word_embeddings"] = "output.weight" not in self.tensor_info
        cfg["eos_token_id"] = self.field("tokenizer.ggml.eos_token_id")
        cfg["bos_token_id"] = self.field("tokenizer.ggml.bos_token_id")
        if model_type == "qwen2_moe":
            cfg["qkv_bias"] = "blk.0.attn_q.bias" in self.tensor_info
        if self.arch in ("deepseek2", "deepseek32"):
            cfg.update(deepseek2_config(self.field, self.arch))
        if self.arch == "glm4moe":
            cfg.update(glm4moe_config(self.field, self.arch, set(self.tensor_info)))
        if self.arch == "llama":
            cfg.update(llama_moe_config(self.field, self.arch))
        if self.arch == "gpt-oss":
            cfg.update(gpt_oss_config(self.field, self.arch, set(self.tensor_info)))
        if self.arch in LINEAR_ATTN:
            cfg.update(qwen3next_config(self.field, self.arch, set(self.tensor_info)))
        if self.arch == "minimax-m2":
            cfg.update(minimax_m2_config(self.field, self.arch, set(self.tensor_info)))
        if self.arch == "kimi-linear":
            cfg.update(kimi_linear_config(self.field, self.arch))
        if "rope_parameters" not in cfg:  # any family's YaRN (Qwen3's long-context files)
            scaling = yarn_rope(self.field, self.arch)
            if scaling:
                cfg["rope_parameters"] = scaling
        return cfg

    def _packed_layers(self) -> tuple[dict[int, str], dict[str, str]]:
        """Every layer with routed experts -> "int8" (all q8_0), "int4" (all q4_K) or "gguf"
        (anything else); and the expert tensors converted at load, each with its target
        (types no kernel reads, and gate/up pairs of two types)."""
        kinds: dict[int, dict[str, object]] = {}
        for name, t in self.tensor_info.items():
            m = _EXPERTS.match(name)
            if m:
                kinds.setdefault(int(m.group(1)), {})[m.group(2)] = t
        packed, convert = {}, {}
        for layer, tensors in kinds.items():
            types = {p: t.tensor_type.name for p, t in tensors.items()}  # type: ignore[attr-defined]
            pair = types.get("gate") != types.get("up")
            mixed_mxfp4 = "MXFP4" in types.values() and len(set(types.values())) > 1
            for proj, t in tensors.items():
                kind = types[proj]
                # MXFP4 is kept where the whole layer is (cpu-mxfp4); cpu-gguf does not read it
                if kind in KEPT and not (pair and proj != "down") and not mixed_mxfp4:
                    continue
                bpw = BITS.get(kind, 32.0)
                if proj != "down":  # gate and up share one fused matrix: one target
                    bpw = min(BITS.get(types.get(p, ""), 32.0) for p in ("gate", "up"))
                k = int(t.shape[0])  # type: ignore[attr-defined]
                convert[f"blk.{layer}.ffn_{proj}_exps.weight"] = convert_target(bpw, k)
            names = set(types.values())
            plain = {"Q8_0": "int8", "Q4_K": "int4", "MXFP4": "mxfp4"}
            whole = len(names) == 1 and not set(convert) & {f"blk.{layer}.ffn_{p}_exps.weight"
                                                            for p in types}  # fmt: skip
            packed[layer] = plain.get(next(iter(names)), "gguf") if whole else "gguf"
        return packed, convert

    @property
    def packed_fmt(self) -> str | None:
        fmts = set(self.packed_layers.values())
        return None if not fmts else fmts.pop() if len(fmts) == 1 else "gguf"

    def summary(self) -> str:
        """One line: per tensor type, what the load did with it (kept, converted to what, with
        the largest relative RMS error against the file's numbers of any expert matrix
        converted)."""
        parts = [f"{what} x{n}" for what, n in sorted(self._done.items())]
        for (kind, to), (n, err) in sorted(self._converted.items()):
            bpw, bits = BITS.get(kind, 32.0), NATIVE_BPW[to]
            more = "" if bits <= bpw else f", more bits: no native format has <= {bpw}"
            parts.append(f"experts {kind} ({bpw} bpw) -> {to} ({bits} bpw{more}; "
                         f"rel rms {err:.2g}) x{n}")  # fmt: skip
        for (kind, to), (n, err) in sorted(self._linears.items()):
            parts.append(f"linears {kind} -> {to} (rel rms {err:.2g}) x{n}")
        return f"GGUF {self.path.name}: " + ("; ".join(parts) or "no tensors read")

    def _note(self, what: str) -> None:
        self._done[what] = self._done.get(what, 0) + 1

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
        return sum(int(t.n_bytes) for t in self.tensor_info.values())

    def _expert_values(self, t, wanted: list[int]) -> list[QMatrix]:
        """Experts `wanted` of the stacked tensor `t`, each its own copy of its part of the file
        (never the whole tensor at once: the builder lets each go once it is laid out)."""
        kind = t.tensor_type.name
        to = self._convert.get(t.name)
        if to is None:
            self._note(f"experts {kind} kept")
            return [KEPT[kind](t.data[e]) for e in wanted]
        shape = tuple(int(d) for d in reversed(t.shape))[1:]
        values, worst = [], 0.0
        for e in wanted:
            deq = self._gguf.quants.dequantize(t.data[e], t.tensor_type).reshape(shape)
            values.append(converted(deq, to))
            worst = max(worst, relative_rms(values[-1].dequantize().numpy(), deq))
        n, was = self._converted.get((kind, to), (0, 0.0))
        self._converted[(kind, to)] = (n + 1, max(was, worst))
        return values

    def _value(self, t, linear: bool):
        """A tensor as the model takes it: an int8 linear's weight (`linear`) in a format
        Int8Linear reads, anything else in fp32."""
        if linear:
            return self._linear(t)
        self._note(f"{t.tensor_type.name} -> fp32")
        return self._fp32(t)

    def kept(self, name: str) -> bool:
        """Whether tensor `name` (the file's name) is a type an int8 linear keeps as it is."""
        t = self.tensor_info.get(name)
        return t is not None and t.tensor_type.name in LINEARS_KEPT

    def _linear(self, t) -> QMatrix:
        kind = t.tensor_type.name
        if kind in LINEARS_KEPT:
            self._note(f"linears {kind} kept")
            return KEPT[kind](t.data)
        return self._int8(kind, self._fp32(t))

    def _int8(self, kind: str, w: torch.Tensor) -> Int8Rows:
        """One linear's fp32 weight -> int8 in groups of 32 (per row where its columns are not
        whole groups); the caller drops the fp32 tensor."""
        value = Int8Rows.linear_groups(w)
        # the error in fp32 torch, in place: gguf's float64 numpy check held 4x the tensor
        norm = float(w.norm())
        err = float(value.dequantize().sub_(w).norm()) / norm if norm > 0 else 0.0
        to = "int8 per row" if value.group != 32 else "int8 g32"
        n, worst = self._linears.get((kind, to), (0, 0.0))
        self._linears[(kind, to)] = (n + 1, max(worst, err))
        return value

    def _fp32(self, t) -> torch.Tensor:
        q = self._gguf.GGMLQuantizationType
        if t.tensor_type in (q.F32, q.F16):
            return torch.from_numpy(np.array(t.data, dtype=np.float32))
        if t.tensor_type == q.BF16:
            raw = np.ascontiguousarray(t.data).view(np.int16)
            return torch.from_numpy(raw.copy()).view(torch.bfloat16).float()
        shape = tuple(int(d) for d in reversed(t.shape))
        deq = self._gguf.quants.dequantize(t.data, t.tensor_type)
        return torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32).reshape(shape))

    def tensors(
        self, wanted: Callable[[str], bool], int8: Callable[[str], bool] = lambda _: False
    ) -> Iterator[tuple[str, object, int]]:
        """(HF name, value, bytes in the file) of every tensor `wanted` takes; a weight `int8`
        names is an int8 linear's (a QMatrix, see the module docstring)."""
        for name, t in self.tensor_info.items():
            yield from self._tensor(name, t, wanted, int8)
            release_pages(self.parts, t.data)  # its copies are made: the file's pages can go

    def _tensor(
        self, name: str, t, wanted: Callable[[str], bool], int8: Callable[[str], bool]
    ) -> Iterator[tuple[str, object, int]]:
        """What `tensors` yields of the file's tensor `name`."""
        m = _EXPERTS.match(name)
        if m:
            layer = int(m.group(1))
            prefix = f"model.layers.{layer}.mlp.experts"
            n = int(t.shape[-1])
            names = {e: f"{prefix}.{e}.{m.group(2)}_proj.weight" for e in range(n)}
            take = [e for e, hf in names.items() if wanted(hf)]
            values = self._expert_values(t, take)
            release_pages(self.parts, t.data)  # copied: the pages can go before the layer builds
            values.reverse()
            for e in take:  # handed over, not kept here: the last yield builds the layer
                yield names[e], values.pop(), int(t.n_bytes) // n
            return
        if self._transformed(name):  # a family's tensor its converter changed: gguf_family
            yield from self._family_tensor(name, t, wanted, int8)
            return
        hf = self._hf_name(name)
        if not wanted(hf):
            return
        yield hf, self._value(t, len(t.shape) == 2 and int8(hf)), int(t.n_bytes)

    def _hf_name(self, name: str) -> str:
        own = {"deepseek2": DEEPSEEK2_NAMES, "deepseek32": DEEPSEEK32_NAMES,
               "glm4moe": GLM4MOE_NAMES, "gpt-oss": GPT_OSS_NAMES,
               "qwen3next": QWEN3NEXT_NAMES, "qwen35moe": QWEN3NEXT_NAMES,
               "minimax-m2": MINIMAX_M2_NAMES, "kimi-linear": KIMI_LINEAR_NAMES}  # fmt: skip
        own = own.get(self.arch, [])
        table = own + _NAMES
        for pattern, repl in table:
            if re.match(pattern, name):
                return re.sub(pattern, repl, name)
        raise ModelLoadError(
            f"GGUF tensor {name!r} ({self.arch}) has no counterpart in hetserve's model; the "
            "file holds something this loader does not read"
        )
