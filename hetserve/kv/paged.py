"""Paged KV tensors: per layer, one or more tensors indexed by slot (block * block_size + offset).

What a layer stores is declared by the model (`kv_cache_spec`): standard attention stores K and V
per KV head; MLA stores one compressed row (latent + rope part). The layout knows nothing of
requests; the runner hands it slot indices.
"""

from __future__ import annotations

import torch

# Per layer: the shapes of one slot's entries, e.g. [(kv_heads, head_dim), (kv_heads, v_dim)].
KVCacheSpec = list[list[tuple[int, ...]]]


class PagedKVCache:
    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        num_slots = num_blocks * block_size
        self.layers: list[list[torch.Tensor]] = [
            [torch.zeros((num_slots, *shape), dtype=dtype, device=device) for shape in entries]
            for entries in spec
        ]

    @staticmethod
    def bytes_per_block(spec: KVCacheSpec, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        per_slot = sum(int(torch.Size(shape).numel()) for entries in spec for shape in entries)
        return per_slot * block_size * elem

    def nbytes(self) -> int:
        return sum(t.nbytes for entries in self.layers for t in entries)

    def write(self, layer: int, slot_mapping: torch.Tensor, *entries: torch.Tensor) -> None:
        for dst, src in zip(self.layers[layer], entries, strict=True):
            dst.index_copy_(0, slot_mapping, src.to(dst.dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> list[torch.Tensor]:
        return [t.index_select(0, slots) for t in self.layers[layer]]
