"""Paged KV tensors: per layer, one or more tensors indexed by slot (block * block_size + offset).

What a layer stores is declared by the model (`kv_cache_spec`): standard attention stores K and V
per KV head; MLA stores one compressed row (latent + rope part). The layout knows nothing of
requests; the runner hands it slot indices.

The cache may be stored in a narrower dtype than the model computes in (`--kv-cache-dtype`):
`write` rounds rows into it and readers widen what they gather back to their own dtype.
"""

from __future__ import annotations

import torch

# Per layer: the shapes of one slot's entries, e.g. [(kv_heads, head_dim), (kv_heads, v_dim)].
KVCacheSpec = list[list[tuple[int, ...]]]

_KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype `--kv-cache-dtype NAME` stores the cache in. "auto" is the model's dtype on
    every device: on CPU the native decode-attention and fused-decode kernels read fp32 caches
    only, and without them a 16-bit cache decodes slower than fp32 (docs/benchmarks.md)."""
    if name == "auto":
        return model_dtype
    return _KV_DTYPES[name]


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

    def gather(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype | None = None
    ) -> list[torch.Tensor]:
        """The rows at `slots` of each of the layer's tensors, widened to `dtype` if given."""
        rows = [t.index_select(0, slots) for t in self.layers[layer]]
        return rows if dtype is None else [r.to(dtype) for r in rows]
