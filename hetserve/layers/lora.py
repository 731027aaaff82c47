"""LoRA-aware linear layers: the base projection once for the whole batch, then each token's
adapter delta `scale * B (A x)` added to its row (S-LoRA / Punica's batched LoRA, in torch).

`LoRALinear` wraps whatever computes the base (`nn.Linear`, `Int8Linear`, a fused q/k/v
`Int8Linear`, on CPU or CUDA) and holds `max_loras` slots of stacked A/B matrices, filled by the
engine's LoRA manager (engine/lora.py) between forwards. A fused module has one part per
projection (q, k, v); each part's delta lands on its column slice of the output.

Layout, per slot s and part j (R = max rank, P = parts): rows [j*R, j*R + r) of `a[s]` hold part
j's A (the rest zero); rows [s*P*R + j*R, ... + r) of `b` hold part j's `scale * B^T` on the
part's output columns (zero elsewhere). So one matmul projects a row onto every part of a slot,
and one more expands all parts into the output, in place:

- one adapter in this forward (one segment of rows): `y[rows] += (x[rows] @ a[s]^T) @ b[s]`;
- several: every token against every slot in use, `t = x @ a^T`, the other slots' columns
  zeroed by the forward's token mask, `y += t @ b` (Punica's BGMV): three ops per layer however
  many adapters share the batch, instead of two per adapter. The extra multiply-adds are
  tokens x slots x P*R, small beside the base's tokens x in x out for any real layer.

A forward without adapters has no segments: a layer then costs one test beyond its base. MLA's
`kv_b_proj` runs on cached rows, not on the forward's tokens; its attention passes the rows'
segments explicitly (`lora_project`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hetserve.layers.lora_batch import LoRABatch, Segments

__all__ = ["LoRABatch", "LoRALinear", "Segments", "lora_bytes", "lora_project"]


class LoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        parts: list[tuple[str, int]],
        in_features: int,
        max_loras: int,
        max_rank: int,
        batch: LoRABatch,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.base = base
        self._base_forward = base.forward  # skips a second nn.Module.__call__ per projection
        self.part_names = [name for name, _ in parts]
        offsets = [0]
        for _, size in parts:
            offsets.append(offsets[-1] + size)
        self.parts = [(offsets[j], size) for j, (_, size) in enumerate(parts)]
        self.in_features, self.out_features = in_features, offsets[-1]
        self.max_loras, self.max_rank = max_loras, max_rank
        self.cols = len(parts) * max_rank  # columns of `A x` per slot
        self.batch = batch
        self.device, self.dtype = device, dtype
        self._a: torch.Tensor | None = None  # [max_loras, cols, in], allocated on first use
        self._b: torch.Tensor | None = None  # [max_loras * cols, out]
        self._filled = [False] * max_loras  # whether the slot's adapter touches this module

    def forward(self, x: torch.Tensor, segments: Segments | None = None) -> torch.Tensor:
        y = self._base_forward(x)
        if self._a is None:
            return y
        if segments is not None:  # rows that are not this forward's tokens (MLA's cache)
            return self._per_segment(x, y, segments)
        segs = self.batch.segments
        if not segs:
            return y
        if len(segs) == 1:
            return self._per_segment(x, y, segs)
        return self._masked(x, y)

    def _per_segment(self, x: torch.Tensor, y: torch.Tensor, segs: Segments) -> torch.Tensor:
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        c = self.cols
        for start, end, slot in segs:
            if self._filled[slot]:
                t = self.batch.scratch(end - start, c, x2)
                torch.mm(x2[start:end], self._a[slot].t(), out=t)
                y2[start:end].addmm_(t, self._b[slot * c : (slot + 1) * c])
        return y

    def _masked(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        width = (self.batch.max_slot + 1) * self.cols
        t = self.batch.scratch(x2.shape[0], width, x2)
        torch.mm(x2, self._a.view(-1, self.in_features)[:width].t(), out=t)
        t.mul_(self.batch.token_mask(self.cols, t.device))
        y2.addmm_(t, self._b[:width])
        return y

    # ---- slots (the LoRA manager, between forwards) ----------------------------------------
    def set_slot(self, slot: int, weights: list | None) -> None:
        """Put an adapter's per-part weights (LoRAWeights or None, in `part_names` order) into
        `slot`; None (or all parts None) empties the slot for this module."""
        present = any(w is not None for w in weights or ())
        if self._a is None:
            if not present:
                return
            kw = {"device": self.device, "dtype": self.dtype}
            self._a = torch.zeros(self.max_loras, self.cols, self.in_features, **kw)
            self._b = torch.zeros(self.max_loras * self.cols, self.out_features, **kw)
        a, b = self._a[slot], self._b[slot * self.cols : (slot + 1) * self.cols]
        a.zero_()
        b.zero_()
        self._filled[slot] = present
        R = self.max_rank
        for j, w in enumerate(weights if present else ()):
            if w is not None:
                off, size = self.parts[j]
                a[j * R : j * R + w.rank].copy_(w.a)
                b[j * R : j * R + w.rank, off : off + size].copy_((w.b * w.scale).t())

    def part_features(self, j: int) -> tuple[int, int]:
        """(in, out) features of part j."""
        return self.in_features, self.parts[j][1]

    def nbytes(self) -> int:
        if self._a is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self._a, self._b))

    def extra_repr(self) -> str:
        parts = ", ".join(f"{n}={s}" for n, (_, s) in zip(self.part_names, self.parts, strict=True))
        return f"{parts}, max_loras={self.max_loras}, max_rank={self.max_rank}"


def lora_project(
    module: nn.Module, x: torch.Tensor, segments_of: Callable[[LoRABatch], Segments]
) -> torch.Tensor:
    """`module(x)` for rows that are not this forward's tokens (cached rows): a LoRALinear adds
    the deltas of the segments `segments_of(its batch)` names; anything else is just called."""
    if isinstance(module, LoRALinear) and module.batch.segments:
        return module(x, segments_of(module.batch))
    return module(x)


def lora_bytes(model: nn.Module) -> int:
    """Memory held by the LoRA slots of a model's layers."""
    return sum(m.nbytes() for m in model.modules() if isinstance(m, LoRALinear))
