"""LoRABatch: which rows of this forward belong to which LoRA slot, shared by every LoRALinear
of a model. The runner sets it once per forward and clears it after; only the engine thread
touches it.

The executor orders each batch by adapter, so each adapter's tokens are one contiguous run of
rows (`segments`, Punica's SGMV layout). From them it builds, once per forward and only when some
layer asks, the per-token slot index and, per layer width, the mask that keeps each token's own
slot's columns (`token_mask`). Every buffer here grows to the largest size seen and is reused, so
a step allocates nothing.
"""

from __future__ import annotations

import torch

Segments = tuple[tuple[int, int, int], ...]  # (first row, end row, slot)


class LoRABatch:
    def __init__(self) -> None:
        self.segments: Segments = ()  # over this forward's token rows
        self.max_slot = -1  # highest slot this forward uses
        self._tokens = 0
        self._spans: tuple[int | None, ...] = ()  # slot of each prefill span (meta.seqs order)
        self._decodes: Segments = ()  # runs over the decode batch's sequence order
        self._masks: dict[tuple[torch.device, int], torch.Tensor] = {}  # this forward's
        self._index: dict[torch.device, torch.Tensor] = {}  # this forward's slot index
        self._buffers: dict[tuple, torch.Tensor] = {}  # kept across forwards

    def set(self, seqs: list[tuple[int, int, int | None]], span_starts: list[int]) -> None:
        """seqs: (first token row, tokens, slot or None) per sequence, in batch order;
        span_starts: first rows of the sequences attended as prefill spans (the others are the
        decode batch, in order)."""
        self.clear()
        if all(slot is None for _, _, slot in seqs):
            return
        self.segments = _runs((start, start + n, slot) for start, n, slot in seqs)
        self.max_slot = max(slot for _, _, slot in self.segments)
        self._tokens = sum(n for _, n, _ in seqs)
        spans = set(span_starts)
        slot_at = {start: slot for start, _, slot in seqs}
        self._spans = tuple(slot_at[s] for s in span_starts)
        # a decode row per token (a speculative decode's drafts are rows of their own)
        decode_slots = [slot for start, n, slot in seqs if start not in spans for _ in range(n)]
        self._decodes = _runs((i, i + 1, s) for i, s in enumerate(decode_slots))

    def clear(self) -> None:
        self.segments, self.max_slot, self._spans, self._decodes = (), -1, (), ()
        self._masks.clear()
        self._index.clear()

    def span_segments(self, span: int, rows: int) -> Segments:
        """Segments of `rows` cached rows read by prefill span `span`."""
        slot = self._spans[span] if self._spans else None
        return () if slot is None else ((0, rows, slot),)

    def decode_segments(self, rows_per_seq: int) -> Segments:
        """Segments of the decode batch's cached rows, `rows_per_seq` per sequence."""
        n = rows_per_seq
        return tuple((a * n, b * n, slot) for a, b, slot in self._decodes)

    def token_mask(self, cols_per_slot: int, device: torch.device) -> torch.Tensor:
        """[tokens, (max_slot + 1) * cols_per_slot] bool: True where a column belongs to the
        token's own slot (column c is slot c // cols_per_slot's)."""
        key = (device, cols_per_slot)
        mask = self._masks.get(key)
        if mask is None:
            width = (self.max_slot + 1) * cols_per_slot
            cols = self._column_slots(key, width)
            index = self.slot_index(device)
            mask = self._buffer(("mask", *key), self._tokens * width, torch.bool, device)
            mask = mask.view(self._tokens, width)
            torch.eq(index[:, None], cols[None, :], out=mask)
            self._masks[key] = mask
        return mask

    def _column_slots(self, key: tuple[torch.device, int], width: int) -> torch.Tensor:
        """[width] long: the slot of each column (a constant, built once per layer width)."""
        cols = self._buffers.get(("cols", *key))
        if cols is None or cols.numel() < width:
            cols = torch.arange(width, device=key[0]) // key[1]
            self._buffers[("cols", *key)] = cols
        return cols[:width]

    def slot_index(self, device: torch.device) -> torch.Tensor:
        """[tokens] long: each token's slot, -1 for the base model."""
        index = self._index.get(device)
        if index is None:
            index = self._buffer(("index", device), self._tokens, torch.long, device)
            index.fill_(-1)
            for start, end, slot in self.segments:
                index[start:end].fill_(slot)
            self._index[device] = index
        return index

    def scratch(self, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        """A [rows, cols] work buffer shared by the layers (one runs at a time)."""
        buf = self._buffer(
            ("scratch", like.device, like.dtype), rows * cols, like.dtype, like.device
        )
        return buf.view(rows, cols)

    def _buffer(self, key: tuple, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1 << 12), dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel]


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
