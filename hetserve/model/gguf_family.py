"""The tensors of a GGUF file that llama.cpp's converter changed for its family, put back in
HF's form: DeepSeek's split MLA kv_b (attn_k_b / attn_v_b), gpt-oss's expert biases, Qwen3-Next's
and Qwen3.5's Gated DeltaNet tensors (and their zero-centred norms), Kimi-Linear's KDA tensors,
llama (Mixtral) q / k rows in llama.cpp's rotary order, and the shared-expert gate that
llama.cpp's own writer stores with one dimension.

Who calls it: `GgufCheckpoint` (model/gguf_file.py) inherits `FamilyTensors`; `_transformed`
says whether a tensor takes this path and `_family_tensor` yields (HF name, value, bytes) as
`GgufCheckpoint.tensors` does. The values are pure functions of the file's numbers
(model/gguf_archs.py); a partner tensor missing (attn_v_b, attn_gate, ffn_up_exps.bias) is a
ModelLoadError naming the tensor.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hetserve.errors import ModelLoadError
from hetserve.model.gguf_archs import (
    KDA_CHANGED,
    ZERO_CENTRED_GGUF,
    fuse_kv_b,
    fuse_qkvz,
    kda_value,
    linear_attn_value,
    unpermute_rope,
)
from hetserve.quant.packed import QMatrix

LINEAR_ATTN = ("qwen3next", "qwen35moe")  # Gated DeltaNet layers (gguf_archs)
_DELTANET = re.compile(r"^blk\.(\d+)\.(ssm_\w+|attn_qkv|attn_gate)(\.weight|\.bias)?$")
_ROPE_PERMUTED = re.compile(r"^blk\.\d+\.attn_(q|k)\.weight$")  # llama's q / k (gguf_archs)
_KV_SPLIT = re.compile(r"^blk\.(\d+)\.attn_(k|v)_b\.weight$")
_EXPERT_BIAS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.bias$")  # gpt-oss
_SHEXP_GATE = re.compile(r"^blk\.\d+\.ffn_gate_inp_shexp\.weight$")
Wanted = Callable[[str], bool]


class FamilyTensors:
    """Mixed into GgufCheckpoint, whose reading helpers (_fp32, _value, _int8, _note,
    _hf_name, hf_config, tensor_info, arch) these methods use."""

    arch: str
    tensor_info: dict[str, Any]
    _fp32: Callable[[Any], torch.Tensor]
    _value: Callable[[Any, bool], Any]
    _int8: Callable[[str, torch.Tensor], Any]
    _note: Callable[[str], None]
    _hf_name: Callable[[str], str]
    hf_config: Callable[[], dict]
    field: Callable[..., Any]

    @functools.cached_property
    def _deltanet_sizes(self) -> tuple[int, int, int, int]:
        """Key heads, value heads, key and value head dims of the Gated DeltaNet layers, read
        from the config once (not rebuilt per tensor)."""
        cfg = self.hf_config()
        return (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"],
                cfg["linear_key_head_dim"], cfg["linear_value_head_dim"])  # fmt: skip

    def _family_kind(self, name: str) -> str | None:
        """How its family's converter changed the file's tensor `name`, or None (unchanged):
        the one predicate behind `_transformed` and `_family_tensor`."""
        if _KV_SPLIT.match(name):
            return "kv_b"
        if _EXPERT_BIAS.match(name):
            return "expert_bias"
        if self.arch == "kimi-linear" and KDA_CHANGED.match(name):
            return "kda"
        if self.arch == "llama" and _ROPE_PERMUTED.match(name):
            return "rope"
        if _SHEXP_GATE.match(name):  # [hidden] as llama.cpp's quantizer writes it, not [1, hidden]
            return "shexp_gate" if len(self.tensor_info[name].shape) == 1 else None
        if self.arch in LINEAR_ATTN and (_DELTANET.match(name) or ZERO_CENTRED_GGUF.search(name)):
            return "linear_attn"
        return None

    def _transformed(self, name: str) -> bool:
        """Whether the file's tensor `name` is one its family's converter changed."""
        return self._family_kind(name) is not None

    def _family_tensor(
        self, name: str, t, wanted: Wanted, int8: Wanted
    ) -> Iterator[tuple[str, object, int]]:
        """What `GgufCheckpoint.tensors` yields of a `_transformed` tensor."""
        kind = self._family_kind(name)
        if kind == "kv_b":
            yield from self._kv_b(name, wanted, int8)
            return
        if kind == "expert_bias":
            yield from self._expert_bias(name, wanted)
            return
        if kind == "linear_attn":
            yield from self._linear_attn(name, t, wanted, int8)
            return
        hf = self._hf_name(name)
        if not wanted(hf):
            return
        if kind == "kda":
            self._note(f"{t.tensor_type.name} -> fp32")
            yield hf, kda_value(name, self._fp32(t)), int(t.n_bytes)
        elif kind == "rope":
            yield hf, self._unpermuted(t, len(t.shape) == 2 and int8(hf)), int(t.n_bytes)
        else:  # the shared-expert gate: [1, hidden] again
            w = self._fp32(t).reshape(1, -1)
            yield hf, self._int8(t.tensor_type.name, w) if int8(hf) else w, int(t.n_bytes)

    def _kv_b(
        self,
        name: str,
        wanted: Callable[[str], bool],
        int8: Callable[[str], bool] = lambda _: False,
    ) -> Iterator[tuple[str, object, int]]:
        """Newer converters split DeepSeek's kv_b_proj into attn_k_b and attn_v_b; it is fused
        back (in fp32) at attn_k_b, unless the file also holds the fused attn_kv_b."""
        layer, part = _KV_SPLIT.match(name).groups()  # type: ignore[union-attr]
        hf = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        if part == "v" or f"blk.{layer}.attn_kv_b.weight" in self.tensor_info or not wanted(hf):
            return
        k_t = self.tensor_info[name]
        v_t = self.tensor_info.get(f"blk.{layer}.attn_v_b.weight")
        if v_t is None:
            raise ModelLoadError(f"GGUF tensor {name!r} has no attn_v_b beside it")
        if int8(hf):  # fp32 for this one matrix only, noted as what it becomes
            value = self._int8(k_t.tensor_type.name, fuse_kv_b(self._fp32(k_t), self._fp32(v_t)))
        else:
            value = fuse_kv_b(self._value(k_t, False), self._value(v_t, False))
        yield hf, value, int(k_t.n_bytes) + int(v_t.n_bytes)

    def _linear_attn(
        self, name: str, t, wanted: Callable[[str], bool], int8: Callable[[str], bool]
    ) -> Iterator[tuple[str, object, int]]:
        """A qwen3next / qwen35moe tensor that llama.cpp's converter changed, back in HF's
        form (gguf_archs.linear_attn_value), in fp32 from the file's numbers (an int8 linear
        rounded from them): zero-centred norms as w (the model adds the 1 back: the same fp32
        number), Qwen3-Next's attn_qkv and attn_gate fused back into in_proj_qkvz."""
        hf = self._hf_name(name)
        if ZERO_CENTRED_GGUF.search(name):
            if wanted(hf):
                yield hf, self._value(t, False) - 1.0, int(t.n_bytes)
            return
        fused = self.arch == "qwen3next"
        if fused and name.endswith("attn_gate.weight"):
            return  # read with attn_qkv
        layer = int(name.split(".")[1])
        nk, nv, dk, dv = self._deltanet_sizes
        nbytes = int(t.n_bytes)
        if fused and name.endswith("attn_qkv.weight"):
            hf = hf.replace("in_proj_qkv", "in_proj_qkvz")
            if not wanted(hf):
                return
            gate = self.tensor_info.get(f"blk.{layer}.attn_gate.weight")
            if gate is None:
                raise ModelLoadError(f"GGUF tensor {name!r} has no attn_gate beside it")
            w = fuse_qkvz(self._fp32(t), self._fp32(gate), nk, dk)
            nbytes += int(gate.n_bytes)
        elif not wanted(hf):
            return
        else:  # qwen3next's value heads are in HF's order: no reorder (equal heads)
            leaf = hf.split(".linear_attn.")[1]
            w = linear_attn_value(leaf, self._fp32(t), (nk, nk if fused else nv, dk, dv))
        kind = t.tensor_type.name
        if w.ndim == 2 and int8(hf):
            yield hf, self._int8(kind, w), nbytes
        else:
            self._note(f"{kind} -> fp32")
            yield hf, w, nbytes

    def _expert_bias(self, name: str, wanted: Callable[[str], bool]):
        """gpt-oss's expert biases as its checkpoints hold them: down's [E, H] as it is, gate's
        and up's [E, I] interleaved into one [E, 2I] (gate the even columns), read at gate's."""
        layer, proj = _EXPERT_BIAS.match(name).groups()  # type: ignore[union-attr]
        prefix = f"model.layers.{layer}.mlp.experts"
        hf = f"{prefix}.{'down_proj' if proj == 'down' else 'gate_up_proj'}_bias"
        if proj == "up" or not wanted(hf):
            return
        t = self.tensor_info[name]
        if proj == "down":
            yield hf, self._value(t, False), int(t.n_bytes)
            return
        up = self.tensor_info.get(f"blk.{layer}.ffn_up_exps.bias")
        if up is None:
            raise ModelLoadError(f"GGUF tensor {name!r} has no ffn_up_exps.bias beside it")
        gate_up = torch.stack((self._value(t, False), self._value(up, False)), dim=-1)
        yield hf, gate_up.reshape(gate_up.shape[0], -1), int(t.n_bytes) + int(up.n_bytes)

    def _unpermuted(self, t, linear: bool) -> torch.Tensor | QMatrix:
        """A llama file's q / k weight in HF's row order (an int8 linear's: its rows moved as
        they are, each row keeping its own scales)."""
        kv = t.name.endswith("attn_k.weight")
        heads = self.field(f"llama.attention.head_count{'_kv' if kv else ''}")
        heads = int(heads or self.field("llama.attention.head_count"))
        value = self._value(t, linear)
        if isinstance(value, QMatrix):
            order = unpermute_rope(torch.arange(value.shape[0]), heads)
            return value.rows(order).contiguous()
        return unpermute_rope(value, heads)
