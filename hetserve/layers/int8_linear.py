"""Int8Linear: a drop-in for nn.Linear on CPU with int8 weights (per output channel), or the
checkpoint's own quantized numbers where it has them.

For CPU-only serving: the non-expert linears (attention, shared experts, lm_head) then stream
a quarter of their fp32 bytes per token, or less. Weights:

- by default int8 per output channel, rounded to within scale/2 per element;
- where the loader kept the checkpoint's quantized matrix on the linear (`packed_weight`: a
  GGUF file's q8_0, q4_K, q5_K or q6_K tensor, model/filler.py), exactly those numbers: q8_0 as
  int8 with an fp16 scale per 32 columns, the K-quants as their super-blocks (4.5, 5.5 and
  6.5625 bits per weight). No second rounding, and a q4_K matrix streams 0.56 bytes per weight
  instead of int8's 1 (K-quant activations are rounded to int8 per 256 columns, as llama.cpp's
  q8_K, instead of int16 per row).

Two kernels:

- native (where hetserve's AVX2 kernels build): the routed experts' microkernels on one matrix
  (`hetserve_qlinear`); activations rounded to int16 per row, so the weight rounding dominates
  the error (`activation_bits=8`: to int8 per row, W8A8, whose tiles multiply bytes by bytes at
  about twice the rate; kept-precise projections stay at 16). Streams ~2x fbgemm's bytes/s at
  one token here. Any shape: rows are stored in quads and columns in 32s (q8_0 and K-quant
  columns are whole blocks by their format), zero weights appended (quant/layout.py); the
  kernel pads the input and drops the padded outputs.
- fbgemm's packed GEMM with dynamic activation quantization (per call, reduce_range: 7 bits),
  which dominates its error; a packed matrix is dequantized and requantized to int8 for it.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

from hetserve.quant.quantize import quantize_int8_per_channel

if TYPE_CHECKING:
    from hetserve.quant.kernel_file import LinearLayout
    from hetserve.quant.packed import QMatrix

# The native kernel's int8 format (F_I8 in hetserve/native/moe_job.h); a GGUF block type's
# own number is its class's `native`.
_INT8 = 1
_A8 = 1 << 10  # F_A8: or'd into the format, activation rows rounded to int8 (W8A8)


def _a8_flag(activation_bits: int, residual: bool) -> int:
    """F_A8 for W8A8 on the native kernel; a residual (16-bit-class) linear keeps int16
    activations."""
    if activation_bits not in (8, 16):
        raise ValueError(f"activation_bits must be 8 or 16, got {activation_bits}")
    return _A8 if activation_bits == 8 and not residual else 0


def _native_ok() -> bool:
    from hetserve import envs
    from hetserve.native import native_unavailable_reason

    return envs.native_kernels() and not native_unavailable_reason()


def _quads_padded(q: torch.Tensor, fmt: int, group: int) -> torch.Tensor:
    """[N, K] -> rows padded to whole quads and columns to the kernel's multiple, with zeros."""
    from hetserve.quant.layout import pad_tensor, padded_size, round_up

    n, k = q.shape
    return pad_tensor(q, round_up(n, 4), padded_size(fmt, group, k))


def _native_packed(packed: QMatrix | None) -> bool:
    """A checkpoint matrix the native kernel reads as it is: q2_K-q6_K, IQ4_XS, IQ4_NL,
    or int8 per row (any width: padded) or in groups of a multiple of 16 columns (q8_0)."""
    from hetserve.quant.packed import BlockRows, Int8PerRow, Int8Rows

    if isinstance(packed, BlockRows | Int8PerRow):  # every GGUF block type
        return True
    return isinstance(packed, Int8Rows) and packed.group % 16 == 0


class Int8Linear(nn.Module):
    """`residual` (native kernel only): each row also keeps its rounding error, itself rounded
    to int8 per row, as N more rows of the same matrix; one kernel call computes both and the
    halves are summed. |w - w_hat| <= max|w| / (127 * 254 * 2) per row: 16-bit-class weights
    (and int16 activations), at 2 bytes a weight."""

    def __init__(
        self,
        linear: nn.Linear,
        kernel: str = "auto",
        residual: bool = False,
        activation_bits: int = 16,
    ) -> None:
        super().__init__()
        self._act_flag = _a8_flag(activation_bits, residual)
        bias = None if linear.bias is None else linear.bias.detach().float().cpu()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._rows = self.out_features
        packed = getattr(linear, "packed_weight", None)
        native = kernel != "fbgemm" and _native_ok()
        if residual and not native:
            raise ValueError("an int8 residual needs the native kernel")
        if native and _native_packed(packed) and not residual:
            self._native_layout(packed, bias)
            return
        # a kept matrix (the linear's weight may be unallocated then: a GGUF load) is the weight
        w = packed.dequantize() if packed is not None else linear.weight.detach().float().cpu()
        q, scale = quantize_int8_per_channel(w)
        if residual:
            q2, scale2 = quantize_int8_per_channel(w - q.float() * scale[:, None])
            q, scale = torch.cat((q, q2)), torch.cat((scale, scale2))
            self._rows = 2 * self.out_features
        self.nbytes = q.numel() + scale.numel() * 4
        self.fmt, self.group, self.kind = _INT8, 0, "int8"
        if native:
            self._set_native_int8(q, scale, bias)
            return
        self.kernel = "fbgemm"
        zero = torch.zeros(q.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated, fbgemm is not
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
            self._packed = torch.ops.quantized.linear_prepack(qw, bias)

    @classmethod
    def from_layout(
        cls, layout: LinearLayout, bias: torch.Tensor | None, activation_bits: int = 16
    ) -> Int8Linear:
        """The Int8Linear whose kernel bytes are `layout` as they are (a converted checkpoint's
        mapped file: model/converted.py), read in place: what `kernel_layout()` gave when the
        checkpoint was converted. Refuses (ModelLoadError, one line) a layout this build's
        kernel would have shaped otherwise."""
        from hetserve.errors import ModelLoadError
        from hetserve.quant.layout import padded_size, round_up

        if not _native_ok():
            raise ModelLoadError("a kernel-layout linear needs the native kernels")
        cols = padded_size(layout.fmt, layout.group, layout.in_features)
        want = (round_up(layout.rows, 4) // 4, cols // 16, 4, 16)
        if layout.fmt != _INT8 or layout.group or tuple(layout.w.shape) != want:
            raise ModelLoadError(
                f"a converted linear is laid out as {tuple(layout.w.shape)} (format "
                f"{layout.fmt}), this build's kernel reads {want}; re-run hetserve convert"
            )
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._act_flag = _a8_flag(activation_bits, layout.rows != layout.out_features)
        self.in_features, self.out_features = layout.in_features, layout.out_features
        self._rows = layout.rows
        self.nbytes = layout.rows * layout.in_features + layout.rows * 4
        self.fmt, self.group, self.kind = _INT8, 0, "int8"
        self._set_native(layout.w, layout.scale, None if bias is None else bias.float())
        return self

    def kernel_layout(self) -> LinearLayout:
        """This linear's kernel bytes, for `hetserve convert` to store (int8 per row only)."""
        if self.kernel != "native" or self.fmt != _INT8 or self.group:
            raise ValueError(f"only a native per-row int8 linear has a stored layout ({self})")
        from hetserve.quant.kernel_file import LinearLayout

        return LinearLayout(fmt=self.fmt, group=self.group, in_features=self.in_features,
                            out_features=self.out_features, rows=self._rows, w=self._q,
                            scale=self._scale)  # fmt: skip

    def _native_layout(self, packed: QMatrix, bias: torch.Tensor | None) -> None:
        """The checkpoint's numbers in the kernel's quad layout (only bytes move)."""
        from hetserve.native import hugepage_empty
        from hetserve.quant.lane_order import KERNEL_ORDER
        from hetserve.quant.layout import (
            fp16_group_scales,
            interleave_quads,
            pad_qmatrix,
            padded_size,
            q4k_layout,
            round_up,
        )
        from hetserve.quant.packed import BlockRows, Q4KRows

        self.nbytes = packed.nbytes
        n, k = packed.shape
        if isinstance(packed, Q4KRows):  # rows padded to quads (its columns: whole blocks)
            self.fmt, self.group, self.kind = packed.native, 0, "q4_K"
            packed = pad_qmatrix(packed, round_up(n, 4), k)
            out = hugepage_empty((round_up(n, 4) // 4, k // 256, 576), torch.uint8)
            self._set_native(q4k_layout(packed, out), None, bias)
            return
        if isinstance(packed, BlockRows):  # the file's rows, padded to quads (IQ4_NL: to 256)
            self.fmt, self.group, self.kind = packed.native, 0, packed.fmt
            padded = pad_qmatrix(packed, round_up(n, 4), padded_size(self.fmt, 0, k))
            raw = padded.raw  # type: ignore[attr-defined]
            if type(packed) in KERNEL_ORDER:  # regrouped for the row kernels (lane_order.py)
                raw = KERNEL_ORDER[type(packed)](raw)
            self._set_native(raw.contiguous(), None, bias)
            return
        self.fmt, self.group, self.kind = _INT8, (0 if packed.group == k else packed.group), "int8"
        if not self.group:
            self._set_native_int8(packed.q, packed.scale.float().reshape(-1), bias)
            return
        packed = pad_qmatrix(packed, round_up(n, 4), padded_size(_INT8, self.group, k))
        w = interleave_quads(packed.q.unsqueeze(0), 16)[0]
        # [N / 4][K / G][4] fp16 (GGUF q8_0's own), beside the quads
        scale = interleave_quads(fp16_group_scales(packed.scale).unsqueeze(0), 1)[0]
        self._set_native(w, scale.reshape(-1).contiguous(), bias)

    def _set_native_int8(self, q: torch.Tensor, scale: torch.Tensor, bias) -> None:
        """int8 [N, K] with a scale per row, padded (zero rows and columns) into quads."""
        from hetserve.quant.layout import interleave_quads

        q = _quads_padded(q, _INT8, 0)
        scale = torch.cat((scale.float(), scale.new_zeros(q.shape[0] - scale.shape[0])))
        self._set_native(interleave_quads(q.unsqueeze(0), 16)[0], scale.contiguous(), bias)

    def _set_native(self, w: torch.Tensor, scale: torch.Tensor | None, bias) -> None:
        from hetserve.native import kernel

        self.kernel = "native"
        self._fn = kernel("hetserve_qlinear")
        self._q, self._scale, self._bias = w, scale, bias
        self._scale_ptr = None if scale is None else scale.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "native" and x.dim() == 2 and x.dtype is torch.float32:
            return self._native(x)  # the decode step's case: no reshapes or casts around it
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        if self.kernel == "native":
            y = self._native(x2)
        else:
            y = torch.ops.quantized.linear_dynamic(x2, self._packed, True)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def _native(self, x2: torch.Tensor) -> torch.Tensor:
        x2 = x2.contiguous()
        y = torch.empty(x2.shape[0], self._rows, dtype=torch.float32)
        rc = self._fn(
            self.kernel_fmt(), self.group, torch.get_num_threads(), x2.shape[0], self._rows,
            self.in_features, x2.data_ptr(), y.data_ptr(), self._q.data_ptr(), self._scale_ptr,
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("native quantized linear could not allocate its activation buffer")
        if self._rows != self.out_features:  # the residual rows: add them to the rounded ones
            y = y[:, : self.out_features].add_(y[:, self.out_features :])
        return y if self._bias is None else y.add_(self._bias)

    def kernel_fmt(self) -> int:
        """The format hetserve_qlinear takes: W8A8's flag on int8 with a scale per row (the byte
        tiles' case; grouped int8 and the K-quants keep their activations). Every caller of the
        kernel (this module, the fused decode step) passes this, so prefill and decode agree."""
        return self.fmt | (self._act_flag if self.fmt == _INT8 and not self.group else 0)

    def extra_repr(self) -> str:
        what = f"int8 groups of {self.group}" if self.group else self.kind
        if self.kernel == "native" and self.kernel_fmt() & _A8:
            what += ", int8 activations"
        if self._rows != self.out_features:
            what += " + int8 residual"
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, {what} ({self.kernel})"


def _fuse(module: nn.Module, activation_bits: int = 16) -> int:
    """Where `module` declares projections that read the same input (`fused_projections`, e.g.
    attention's q/k/v), store them as one Int8Linear: one weight stream and one kernel call
    instead of three. The separate projections become None. Checkpoint matrices of one format
    and group are concatenated as they are; projections holding matrices of different formats
    (a GGUF Q4_K_M file's q4_K q / k beside a q6_K v, rounded to int8 groups) stay apart, each
    on its own numbers."""
    count = 0
    declared = getattr(module, "fused_projections", None)
    for fused_name, parts in (declared() if declared else {}).items():
        lins = [getattr(module, p, None) for p in parts]
        if not all(type(lin) is nn.Linear for lin in lins):
            continue
        mapped = getattr(lins[0], "mapped_layout", None)  # the fused linear's stored bytes
        if mapped is not None and all(getattr(lin, "mapped_layout", None) is mapped
                                      for lin in lins):  # fmt: skip
            bias = None if lins[0].bias is None else torch.cat([lin.bias for lin in lins])
            setattr(module, fused_name, Int8Linear.from_layout(mapped, bias, activation_bits))
            for p in parts:
                setattr(module, p, None)
            count += len(parts)
            continue
        if len({lin.in_features for lin in lins}) != 1:
            continue
        if len({lin.bias is None for lin in lins}) != 1:
            continue
        packed = [getattr(lin, "packed_weight", None) for lin in lins]
        kinds = {(type(p), p.group) if p is not None else None for p in packed}
        if len(kinds) > 1 and (None not in kinds or any(lin.weight.is_meta for lin in lins)):
            continue
        with torch.no_grad():
            big = nn.Linear(lins[0].in_features, sum(lin.out_features for lin in lins),
                            bias=lins[0].bias is not None, device="meta")  # fmt: skip
            if any(lin.weight.is_meta for lin in lins):  # left unallocated by the loader
                # (no torch.cat on meta tensors: its Python reference imports torch._dynamo, ~1 s)
                shape = (big.out_features, big.in_features)
                big.weight = nn.Parameter(torch.empty(shape, dtype=lins[0].weight.dtype,
                                                      device="meta"))  # fmt: skip
            else:
                big.weight = nn.Parameter(torch.cat([lin.weight for lin in lins]))
            if lins[0].bias is not None:
                big.bias = nn.Parameter(torch.cat([lin.bias for lin in lins]))
        if len(kinds) == 1 and None not in kinds:
            big.packed_weight = type(packed[0]).cat_rows(packed)
        setattr(module, fused_name, Int8Linear(big, activation_bits=activation_bits))
        for p in parts:
            setattr(module, p, None)
        count += len(parts)
    return count


def int8_linear(linear: nn.Linear, activation_bits: int = 16) -> Int8Linear:
    """The Int8Linear of `linear`: from the bytes a converted checkpoint stored for it where the
    loader handed them over (`mapped_layout`, model/converted.py: a kept-precise projection's
    with its residual rows), else rounded from its weight (or its checkpoint matrix)."""
    mapped = getattr(linear, "mapped_layout", None)
    if mapped is not None:
        return Int8Linear.from_layout(mapped, linear.bias, activation_bits)
    return Int8Linear(linear, activation_bits=activation_bits)


def kept_precise(parent: nn.Module, name: str) -> bool:
    """Whether `parent` keeps its linear `name` finer than int8 (`precise_projections`)."""
    return name in getattr(parent, "precise_projections", ())


def quantize_linears(module: nn.Module, activation_bits: int = 16) -> int:
    """Replace every nn.Linear inside `module` (not `module` itself) by an Int8Linear. Those
    their parent declares in `precise_projections` keep their int8 rounding error too (an int8
    residual, 16-bit class) on the native kernel, or stay in the engine's dtype without it
    (fbgemm's 7-bit activations would undo the residual)."""
    count = _fuse(module, activation_bits)
    for name, child in list(module.named_children()):
        # A checkpoint's own quantized numbers (GGUF) are as precise as they get: kept as they
        # are; a converted checkpoint's stored bytes (mapped_layout) carry their residual rows.
        stored = hasattr(child, "packed_weight") or hasattr(child, "mapped_layout")
        if kept_precise(module, name) and not stored:
            if isinstance(child, nn.Linear) and _native_ok():
                setattr(module, name, Int8Linear(child, residual=True))
                count += 1
            continue
        if isinstance(child, nn.Linear):
            setattr(module, name, int8_linear(child, activation_bits))
            count += 1
        else:
            count += quantize_linears(child, activation_bits)
    return count
