"""How many paged KV blocks an engine allocates, from its configuration and the model's cache
layout alone: `EngineCore` sizes its cache with it, and the loader's `--max-host-memory`
estimate (`model/build.py`) prices the same cache before any weight is read. Pure: no
allocation, no I/O. Failure: a budget that cannot hold one full-length sequence is an
`InvalidInputError` naming the fix.
"""

from __future__ import annotations

import math

import torch

from hetserve.config import EngineConfig
from hetserve.config_sections import CPU_KV_CAP_BYTES
from hetserve.errors import InvalidInputError
from hetserve.kv.paged import KVCacheSpec, PagedKVCache


def num_kv_blocks(
    cfg: EngineConfig,
    max_model_len: int,
    spec: KVCacheSpec,
    dtype: torch.dtype,
    reserved_bytes: int = 0,
) -> int:
    """KV blocks to allocate: `--num-kv-blocks`, else what the byte budget holds after
    `reserved_bytes` (the state slots), never more than `max_num_seqs` full-length sequences
    need."""
    bs = cfg.cache.block_size
    per_seq = math.ceil(max_model_len / bs)
    if cfg.cache.num_blocks is not None:
        n = cfg.cache.num_blocks
    else:
        per_block = max(PagedKVCache.bytes_per_block(spec, bs, dtype), 1)
        budget = (cfg.cache.kv_cache_bytes or CPU_KV_CAP_BYTES) - reserved_bytes
        n = min(max(budget, 0) // per_block, per_seq * cfg.scheduler.max_num_seqs + 1)
    if n - 1 < per_seq:
        raise InvalidInputError(
            f"KV cache of {n} blocks cannot hold one {max_model_len}-token sequence; "
            "give more KV memory or a smaller --max-model-len"
        )
    return n
