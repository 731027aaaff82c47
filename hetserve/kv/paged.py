"""Paged KV tensors: per layer, one or more tensors indexed by slot (block * block_size + offset).

What a layer stores is declared by the model (`kv_cache_spec`): standard attention stores K and V
per KV head; MLA stores one compressed row (latent + rope part). The layout knows nothing of
requests; the runner hands it slot indices.

The cache may be stored in a narrower dtype than the model computes in (`--kv-cache-dtype`):
`write` rounds rows into it and readers widen what they gather back to their own dtype. The
8-bit forms (int8, fp8 e4m3) keep one fp32 scale per slot and row of the last dimension (per
token and KV head for GQA, per token for MLA's latent row) in `scales`, indexed by slot like
the data, so a block's scales are its own rows of those tensors and move with it (`parts`).

On the CPU the tensors are pages of a fresh anonymous mapping, which the OS hands out zeroed
as each is first touched (`zeroed`): the cache costs no time at start-up and takes resident
memory as its blocks are used.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch

# Per layer: the shapes of one slot's entries, e.g. [(kv_heads, head_dim), (kv_heads, v_dim)].
KVCacheSpec = list[list[tuple[int, ...]]]

_KV_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}
# The 8-bit cache dtypes and the largest magnitude each stores: a row is scaled so that its
# largest |value| lands there. int8 rounds to nearest (even), so an element's error is at most
# half a step, scale / 2 = absmax / 254 of its row; e4m3 keeps 3 mantissa bits, 2^-4 relative.
QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, half: bool = False) -> torch.dtype:
    """The dtype `--kv-cache-dtype NAME` stores the cache in. "auto": fp16 where `half` (the
    caller's judgement: the CPU under the all-int8 preset, whose native attention kernels widen
    fp16 in registers, F16C) and the model is fp32; else the model's dtype. Measured on a
    2-core AVX2 host (the 78 MB small MoE, decode tok/s against fp32 at 16 and 2000 tokens of
    context): fp16 1.01x and 1.35x with all-int8 placement (the fused decode step), 1.12x and
    0.92x with fp32 linears; bf16 0.20-0.72x (no bf16 kernel without AVX512-BF16). Exact
    placements (`device`, an fp32 `--dtype`) keep the model's dtype."""
    if name == "auto":
        return torch.float16 if half and model_dtype is torch.float32 else model_dtype
    return _KV_DTYPES[name]


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (rows in the 8-bit `dtype`, fp32 scales [...]) with x ~= q * scale.
    The same arithmetic as the native cache writes (small_ops.c put_row_i8): inv = 127 / absmax
    in fp32, q = round-half-even(x * inv), scale = absmax / 127 (0 for an all-zero row)."""
    x = x.float()
    qmax = QUANT_MAX[dtype]
    amax = x.abs().amax(-1)
    inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
    y = x * inv.unsqueeze(-1)
    if dtype is torch.int8:
        y = y.round()
    q = y.clamp_(-qmax, qmax).to(dtype)  # e4m3 rounds in the conversion
    return q, amax / qmax


_LAZY_BYTES = 1 << 20  # smaller tensors: torch.zeros (a mapping each would waste its pages)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor. On the CPU (Linux), from `_LAZY_BYTES` up, a fresh private anonymous
    mapping: zero by the OS's guarantee and untouched, so allocating it writes nothing (a 2 GiB
    torch.zeros wrote every page: 1.5 s of the engine's start on the 2-core VM) and its pages
    become resident as blocks are written. The tensor holds the mapping; it is unmapped with
    the last view."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < _LAZY_BYTES or sys.platform != "linux":
        return torch.zeros(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


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
        self.dtype = dtype
        # how the CPU prefill kernel multiplies over this cache: bf16 products where the engine
        # chose them (model/build.py's prefill_bf16), else fp32
        self.bf16_prefill = False
        num_slots = num_blocks * block_size
        self.layers: list[list[torch.Tensor]] = [
            [zeroed((num_slots, *shape), dtype, device) for shape in entries] for entries in spec
        ]
        # Per layer, one scale tensor per entry for the 8-bit dtypes (else none).
        self.scales: list[list[torch.Tensor]] = [
            [zeroed((num_slots, *shape[:-1]), torch.float32, device) for shape in entries]
            if dtype in QUANT_MAX
            else []
            for entries in spec
        ]

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANT_MAX

    def parts(self) -> list[torch.Tensor]:
        """Every tensor a block has rows in, in a stored block's part order: the data of each
        layer, then the scales of each layer (none for 16- and 32-bit caches)."""
        return [t for layer in self.layers for t in layer] + [
            t for layer in self.scales for t in layer
        ]

    @staticmethod
    def bytes_per_block(spec: KVCacheSpec, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        shapes = [shape for entries in spec for shape in entries]
        per_slot = sum(int(torch.Size(shape).numel()) for shape in shapes) * elem
        if dtype in QUANT_MAX:  # the fp32 scales beside the rows
            per_slot += 4 * sum(int(torch.Size(shape[:-1]).numel()) for shape in shapes)
        return per_slot * block_size

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.parts())

    def write(self, layer: int, slot_mapping: torch.Tensor, *entries: torch.Tensor) -> None:
        if not self.quantized:
            for dst, src in zip(self.layers[layer], entries, strict=True):
                dst.index_copy_(0, slot_mapping, src.to(dst.dtype))
            return
        pairs = zip(self.layers[layer], self.scales[layer], entries, strict=True)
        for dst, scale, src in pairs:
            q, s = quantize_rows(src, dst.dtype)
            # byte views: index_copy_ has no fp8 kernel on CPU
            dst.view(torch.uint8).index_copy_(0, slot_mapping, q.view(torch.uint8))
            scale.index_copy_(0, slot_mapping, s)

    def rows(
        self, layer: int, entry: int, slots: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Entry `entry` of the layer at `slots`, widened to `dtype` (fp32 where None for an
        8-bit cache: its rows mean nothing without their scales)."""
        t = self.layers[layer][entry]
        if not self.quantized:
            r = t.index_select(0, slots)
            return r if dtype is None else r.to(dtype)
        q = t.view(torch.uint8).index_select(0, slots).view(t.dtype)
        r = q.float() * self.scales[layer][entry].index_select(0, slots).unsqueeze(-1)
        return r if dtype is None else r.to(dtype)

    def gather(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype | None = None
    ) -> list[torch.Tensor]:
        """The rows at `slots` of each of the layer's tensors, widened to `dtype` if given."""
        return [self.rows(layer, i, slots, dtype) for i in range(len(self.layers[layer]))]
