"""LoRA-aware linear layers: the base projection once for the whole batch, then each adapter's
`scale * B (A x)` added to its own tokens' rows (S-LoRA / Punica's batched LoRA, in torch).

`LoRALinear` wraps whatever computes the base (`nn.Linear`, `Int8Linear`, a fused q/k/v
`Int8Linear`, on CPU or CUDA) and holds `max_loras` slots of stacked A/B matrices. A fused module
has one part per projection (q, k, v): each part's delta lands on its column slice of the output.
Slots are filled by the engine's LoRA manager (engine/lora.py), never during a forward.

`LoRABatch` is this forward's layout, shared by every LoRALinear of a model and set by the runner
once per forward: the executor orders each batch by adapter, so an adapter's tokens are one
contiguous run of rows ("segments", Punica's SGMV layout) and its rows are plain views, with no
gather or scatter. A batch without adapters has no segments: each layer then costs one attribute
test beyond its base. MLA's `kv_b_proj` runs on cached rows, not on the batch's tokens; its
attention passes the rows' segments explicitly (`lora_project`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Segments = tuple[tuple[int, int, int], ...]  # (first row, end row, slot)


class LoRABatch:
    """This forward's adapter layout. Set by `ModelRunner.forward` before the model runs and
    cleared after it, on the engine thread."""

    def __init__(self) -> None:
        self.segments: Segments = ()  # over this forward's token rows
        self._spans: tuple[int | None, ...] = ()  # slot of each prefill span (meta.seqs order)
        self._decodes: Segments = ()  # runs over the decode batch's sequence order
        self._scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def set(self, seqs: list[tuple[int, int, int | None]], span_starts: list[int]) -> None:
        """seqs: (first token row, tokens, slot or None) per sequence, in batch order;
        span_starts: first rows of the sequences attended as prefill spans (the others are the
        decode batch, in order)."""
        if all(slot is None for _, _, slot in seqs):
            self.clear()
            return
        self.segments = _runs((start, start + n, slot) for start, n, slot in seqs)
        spans = set(span_starts)
        slot_at = {start: slot for start, _, slot in seqs}
        self._spans = tuple(slot_at[s] for s in span_starts)
        decode_slots = [slot for start, _, slot in seqs if start not in spans]
        self._decodes = _runs((i, i + 1, s) for i, s in enumerate(decode_slots))

    def clear(self) -> None:
        self.segments, self._spans, self._decodes = (), (), ()

    def span_segments(self, span: int, rows: int) -> Segments:
        """Segments of `rows` cached rows read by prefill span `span`."""
        slot = self._spans[span] if self._spans else None
        return () if slot is None else ((0, rows, slot),)

    def decode_segments(self, rows_per_seq: int) -> Segments:
        """Segments of the decode batch's cached rows, `rows_per_seq` per sequence."""
        n = rows_per_seq
        return tuple((a * n, b * n, slot) for a, b, slot in self._decodes)

    def scratch(self, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        """A [rows, cols] work buffer shared by the layers (one forward at a time); it grows to
        the largest shape asked for and is then reused, so steps allocate nothing."""
        key = (like.device, like.dtype)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < rows * cols:
            buf = torch.empty(max(rows * cols, 1 << 16), device=like.device, dtype=like.dtype)
            self._scratch[key] = buf
        return buf[: rows * cols].view(rows, cols)


def _runs(items) -> Segments:
    """Merge consecutive (start, end, slot) items of the same slot; drop slot None."""
    out: list[tuple[int, int, int]] = []
    for start, end, slot in items:
        if slot is None:
            continue
        if out and out[-1][2] == slot and out[-1][1] == start:
            out[-1] = (out[-1][0], end, slot)
        else:
            out.append((start, end, slot))
    return tuple(out)


class LoRALinear(nn.Module):
    """`base(x)` plus, per segment, its slot's `scale_j * B_j (A_j x)` on each part's columns.

    Slot layout (allocated on first use, so modules no adapter targets cost no memory): for a
    slot of rank r, rows [j*r, (j+1)*r) of `_a[slot]` are part j's A (zero-padded to r), so one
    matmul gives every part's `A x`; `_b[j][slot, :, :r]` is part j's B."""

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
        offsets = [0, *torch.tensor([n for _, n in parts]).cumsum(0).tolist()]
        self.parts = [(offsets[j], n) for j, (_, n) in enumerate(parts)]
        self.in_features = in_features
        self.max_loras, self.max_rank = max_loras, max_rank
        self.batch = batch
        self.device, self.dtype = device, dtype
        self._a: torch.Tensor | None = None
        self._b: list[torch.Tensor] = []
        self._rank = [0] * max_loras  # 0: the slot's adapter does not touch this module
        self._scale = [[0.0] * len(parts) for _ in range(max_loras)]

    def forward(self, x: torch.Tensor, segments: Segments | None = None) -> torch.Tensor:
        y = self._base_forward(x)
        segs = self.batch.segments if segments is None else segments
        if not segs or self._a is None:
            return y
        return self._add_deltas(x, y, segs)

    def _add_deltas(self, x: torch.Tensor, y: torch.Tensor, segs: Segments) -> torch.Tensor:
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for start, end, slot in segs:
            r = self._rank[slot]
            if r == 0:
                continue
            k = len(self.parts) * r
            t = self.batch.scratch(end - start, k, x2)
            torch.mm(x2[start:end], self._a[slot, :k].t(), out=t)
            rows = y2[start:end]
            for j, (off, size) in enumerate(self.parts):
                scale = self._scale[slot][j]
                if scale:
                    b = self._b[j][slot, :, :r]
                    rows[:, off : off + size].addmm_(t[:, j * r : (j + 1) * r], b.t(), alpha=scale)
        return y

    # ---- slots (the LoRA manager, between forwards) ----------------------------------------
    def set_slot(self, slot: int, weights: list | None) -> None:
        """Put an adapter's per-part weights (LoRAWeights or None, in `part_names` order) into
        `slot`; None (or all parts None) empties the slot for this module."""
        present = [w for w in (weights or ()) if w is not None]
        if not present:
            self._rank[slot] = 0
            return
        if self._a is None:
            self._allocate()
        r = max(w.rank for w in present)
        a = self._a[slot]
        a.zero_()
        for j, w in enumerate(weights):
            b = self._b[j][slot]
            b.zero_()
            self._scale[slot][j] = 0.0 if w is None else w.scale
            if w is not None:
                a[j * r : j * r + w.rank].copy_(w.a)
                b[:, : w.rank].copy_(w.b)
        self._rank[slot] = r

    def _allocate(self) -> None:
        n = len(self.parts)
        kw = {"device": self.device, "dtype": self.dtype}
        self._a = torch.zeros(self.max_loras, n * self.max_rank, self.in_features, **kw)
        self._b = [torch.zeros(self.max_loras, size, self.max_rank, **kw) for _, size in self.parts]

    def part_features(self, j: int) -> tuple[int, int]:
        """(in, out) features of part j."""
        return self.in_features, self.parts[j][1]

    def nbytes(self) -> int:
        if self._a is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self._a, *self._b))

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
