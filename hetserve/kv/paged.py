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
    """The dtype `--kv-cache-dtype NAME` stores the cache in; "auto" is the model's dtype.
    Measured on a 2-core AVX2 host (the 78 MB small MoE, decode tok/s against fp32 at 16 and
    2000 tokens of context): fp16 1.01x and 1.35x with all-int8 placement (the fused decode
    step), 1.12x and 0.92x with fp32 linears; bf16 0.20-0.72x (no bf16 kernel without
    AVX512-BF16). fp16 is not yet auto's choice on CPU: that changes every CPU default at once."""
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
