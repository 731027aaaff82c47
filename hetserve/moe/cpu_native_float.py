"""The native expert backends of the float block formats: MXFP4 (gpt-oss's e2m1 blocks with
e8m0 scales) and FP8 e4m3 with block scales (DeepSeek-V3, Qwen3 FP8), each reading the
checkpoint's bytes as published (moe/cpu_native.py's module docstring: the kernel, the layouts,
padding).

Who calls it: moe/cpu_backends.py's cpu-mxfp4 and cpu-fp8 factories. Failure: FP8 scale blocks
the kernel cannot read (not a multiple of 16 columns) are an InvalidInputError at construction.
"""

from __future__ import annotations

import math

import torch

from hetserve.errors import InvalidInputError
from hetserve.moe.cpu_native import F_FP8, F_MXFP4, _experts_in, _NativeExperts, _packed_as
from hetserve.moe.experts import ExpertWeights
from hetserve.moe.native_layout import stacked_quads, stacked_tiles
from hetserve.quant.layout import pad_qmatrices, pad_tensor, padded_size, round_up
from hetserve.quant.packed import Fp8Rows, Mxfp4Rows
from hetserve.quant.quantize import quantize_fp8_blocks, quantize_mxfp4


class NativeMxfp4Experts(_NativeExperts):
    """MXFP4 (gpt-oss): the published e2m1 blocks and e8m0 scales, read as they are (only rows
    interleaved 16 at a time, 4 bytes each); int16 activations. Unpacked experts are quantized
    per expert."""

    fmt = F_MXFP4
    group_size = 32

    def _load(self, weights: ExpertWeights) -> None:
        def quantize(w: torch.Tensor) -> Mxfp4Rows:  # zeros appended keep each block's max
            return Mxfp4Rows(*quantize_mxfp4(pad_tensor(w, w.shape[0], round_up(w.shape[1], 32))))

        mats13, mats2 = _experts_in(weights, _packed_as(weights, Mxfp4Rows), quantize)
        hp, ip = self._padded()
        mats13, mats2 = pad_qmatrices(mats13, ip, hp, True), pad_qmatrices(mats2, hp, ip)
        n13, n2 = 2 * ip, hp

        b13, b2 = ([m.blocks.reshape(n, -1) for m in ms] for ms, n in ((mats13, n13), (mats2, n2)))
        s13, s2 = [m.scales for m in mats13], [m.scales for m in mats2]
        mats13.clear(), mats2.clear()  # the four lists alone hold them: the layouts empty those
        self._set(
            stacked_tiles(b13, 4, True), stacked_tiles(s13, 1, True),
            stacked_tiles(b2, 4, False), stacked_tiles(s2, 1, False),
        )  # fmt: skip


class NativeFp8Experts(_NativeExperts):
    """FP8 e4m3 with block scales (DeepSeek-V3 / Qwen3 FP8): the checkpoint's bytes converted in
    registers, to fp32 (fp32 activations: only fp32 rounding), or on the avx512bf16 build to
    bf16 against inputs split into two bf16 (2^-18 of each input; e4m3 subnormals, below 2^-6
    of the block scale, read as zero). Unpacked experts are quantized per
    expert in 128 x 128 blocks."""

    fmt = F_FP8

    def _load(self, weights: ExpertWeights) -> None:
        def quantize(w: torch.Tensor) -> Fp8Rows:
            q, scale = quantize_fp8_blocks(w)
            return Fp8Rows(q, scale.repeat_interleave(128, dim=0)[: w.shape[0]])

        mats13, mats2 = _experts_in(weights, _packed_as(weights, Fp8Rows), quantize)
        # One group size for both matrices (the kernel's G): the largest that divides the
        # block and both sizes padded to 16; block scales repeat over its groups (exactly).
        h16, i16 = (padded_size(F_FP8, 0, n) for n in (self.hidden, self.inter))
        self.group_size = math.gcd(mats13[0].group, h16, i16)
        if any(m.group % self.group_size for m in (*mats13, *mats2)) or self.group_size % 16:
            raise InvalidInputError(
                f"cpu-fp8 reads scale blocks of a multiple of 16 columns; this checkpoint's are "
                f"{sorted({m.group for m in (*mats13, *mats2)})}"
            )
        hp, ip = self._padded()  # h16, i16 (the group divides both)
        mats13, mats2 = pad_qmatrices(mats13, ip, hp, True), pad_qmatrices(mats2, hp, ip)

        def codes(mats) -> list[torch.Tensor]:
            return [m.w.view(torch.uint8) for m in mats]

        def scales(mats) -> list[torch.Tensor]:
            g = self.group_size
            return [  # x 256 undoes the kernel's 2^-8
                m.scale.float().repeat_interleave(m.group // g, dim=-1)[:, : m.shape[-1] // g] * 256
                for m in mats
            ]

        c13, c2, s13, s2 = codes(mats13), codes(mats2), scales(mats13), scales(mats2)
        mats13.clear(), mats2.clear()  # the four lists alone hold them: the layouts empty those
        self._set(
            stacked_quads(c13, 16, True), stacked_quads(s13, 1, True),
            stacked_quads(c2, 16, False), stacked_quads(s2, 1, False),
        )  # fmt: skip
