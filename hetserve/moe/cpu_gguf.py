"""`cpu-gguf`: routed experts of a GGUF file served from each tensor's own block type, where a
layer may mix them (llama.cpp's Q4_K_M keeps gate/up in q4_K and down in q6_K in some layers,
Q5_K_M q5_K beside q6_K, Q2_K / Q3_K_M q2_K and q3_K beside q4_K-q6_K, IQ4_XS files IQ4_NL where
a row is off 256, a size off 256 gets q8_0).

Who uses it: the loader picks it for GGUF experts that are not all q4_K or all q8_0
(`PACKED_BACKENDS`); tests and `bench moe-kernel` build it directly. W13 (gate and up, one type) and
W2 each keep their format on the native kernel (moe_kernels.c: a phase-2 format beside the phase-1
one): q4_K in its quad layout (moe_q4k.h), q6_K, q5_K, q3_K, q2_K, IQ4_XS, IQ4_NL and the grid
i-quants IQ3_*, IQ2_*, IQ1_* rows as the file stores them (moe_kq.h, moe_iqg.h; IQ4_XS with each
block's nibbles regrouped, the same bytes), q8_0 as grouped int8,
int4 groups. The K-quants and 4-bit i-quants meet activations rounded as llama.cpp's q8_K (int8 per
256 columns: |x - x_hat| <= amax / 254 of the super-block; IQ4_NL rows padded to 256 with zero
blocks), q8_0 and int4 int16 per row.
Failure: experts not packed, or a projection whose experts differ in type, is an
InvalidInputError at construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hetserve.errors import InvalidInputError
from hetserve.moe.cpu_backends import _native_only
from hetserve.moe.cpu_native import F_I4, F_I8, F_Q4K, _NativeExperts
from hetserve.moe.experts import Activation, ExpertWeights, register_backend
from hetserve.moe.native_layout import int4_layer, q4k_layer, rows_layer, stacked_quads
from hetserve.quant.layout import fp16_group_scales, pad_qmatrices
from hetserve.quant.packed import BlockRows, Int4Rows, Int8Rows, QMatrix

# int8 (q8_0) and int4 groups; every GGUF block type carries its own number (BlockRows.native),
# q4_K in its quad layout (moe_q4k.h), the others as the file's bytes (moe_kq.h, moe_iqg.h)
_FORMATS: dict[type, int] = {Int8Rows: F_I8, Int4Rows: F_I4}


def _native(kind: type) -> int | None:
    return kind.native if issubclass(kind, BlockRows) else _FORMATS.get(kind)


def _format(mats: Sequence[QMatrix], what: str) -> int:
    kinds = {type(m) for m in mats}
    fmt = _native(next(iter(kinds))) if len(kinds) == 1 else None
    if fmt is None:
        names = sorted(k.__name__ for k in kinds)
        raise InvalidInputError(f"cpu-gguf: {what} experts must share one GGUF type, got {names}")
    return fmt


class NativeGgufExperts(_NativeExperts):
    """Each projection's experts in their own GGUF block type (see the module docstring)."""

    def _load(self, weights: ExpertWeights) -> None:
        p = weights.packed
        if p is None:
            raise InvalidInputError("cpu-gguf serves experts packed in GGUF block types only")
        f13, f2 = _format(p.w13, "gate/up"), _format(p.w2, "down")
        g13, g2 = p.w13[0].group, p.w2[0].group
        for f, g in ((f13, g13), (f2, g2)):
            if f in (F_I8, F_I4) and g % 16:
                raise InvalidInputError(f"cpu-gguf reads int groups of multiples of 16, not {g}")
        # one handle, two formats: moe_kernels.c's fmt_phase / g_phase encoding
        self.fmt = f13 if f13 == f2 and g13 == g2 else f13 | (f2 + 1) << 5
        self.group_size = g13 if f13 == f2 and g13 == g2 else g13 | g2 << 16
        self.formats = (p.w13[0].fmt, p.w2[0].fmt)
        hp, ip = self._padded()
        l13, l2 = weights.packed_lists()
        m13, m2 = pad_qmatrices(l13, ip, hp, True), pad_qmatrices(l2, hp, ip)
        w13, s13 = self._layout(f13, m13, True)
        w2, s2 = self._layout(f2, m2, False)
        self._set(w13, s13, w2, s2)

    @staticmethod
    def _layout(fmt: int, mats: list, gate_up: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One projection's layout; `mats` is emptied as it is laid out (moe/native_layout.py)."""
        if fmt == F_Q4K:
            return q4k_layer(mats, gate_up), None
        if fmt == F_I4:
            return int4_layer(mats, gate_up), None
        if fmt != F_I8:  # the other GGUF block types: the file's rows
            return rows_layer(mats, gate_up), None
        scales = [fp16_group_scales(m.scale) for m in mats]  # grouped int8 (q8_0)
        codes = [m.q for m in mats]
        mats.clear()
        return stacked_quads(codes, 16, gate_up), stacked_quads(scales, 1, gate_up)


@register_backend("cpu-gguf")
def make_cpu_gguf(
    weights: ExpertWeights,
    activation: Activation = "silu",
    num_threads: int | None = None,
    kernel: str = "auto",
) -> NativeGgufExperts:
    _native_only("cpu-gguf", kernel, activation)
    return NativeGgufExperts(weights, activation=activation, num_threads=num_threads)
