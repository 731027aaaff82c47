"""State slots: the fixed-size per-sequence memory of linear-attention layers.

Per state layer, one fp32 tensor per entry of its `StateLayerSpec`, indexed by slot
([num_slots, *shape]). Which slot a request uses (its working slot) and which slots hold prefix
checkpoints is decided by the KV manager (`kv/manager.py`, with a `BlockPool` of slots); this
class only holds the bytes. Slot 0 is never handed out (as block 0 of the paged cache).

States stay fp32 whatever the model's dtype: they accumulate every token of the context.
"""

from __future__ import annotations

import torch

from hetserve.kv.cache_spec import Shape


class StateCache:
    def __init__(
        self, layout: list[list[Shape]], num_slots: int, device: torch.device | str
    ) -> None:
        self.layout = layout
        self.num_slots = num_slots
        self.layers: list[list[torch.Tensor]] = [
            [torch.zeros((num_slots, *shape), dtype=torch.float32, device=device) for shape in e]
            for e in layout
        ]

    def nbytes(self) -> int:
        return sum(t.nbytes for entries in self.layers for t in entries)

    def copy_slot(self, src: int, dst: int) -> None:
        """Every layer's state of slot `src` into slot `dst` (a checkpoint taken or resumed)."""
        for entries in self.layers:
            for t in entries:
                t[dst].copy_(t[src])

    def slot_parts(self, slot: int) -> list[torch.Tensor]:
        """Views of one slot's tensors, layer by layer (what a tier or a hand-off moves)."""
        return [t[slot] for entries in self.layers for t in entries]
