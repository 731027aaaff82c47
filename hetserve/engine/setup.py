"""What the engine is built from before its first step: the model directory (the embedded demo
model by default) and the size of the paged KV cache.

Called by `EngineCore.__init__` (and by benchmarks that load the same checkpoint into a peer).
Failure contract: a KV budget that cannot hold one full-length sequence is an
`InvalidInputError` naming the fix, raised before any KV memory is allocated.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from hetserve.config import CPU_KV_CAP_BYTES, EngineConfig
from hetserve.errors import InvalidInputError
from hetserve.kv.cache_spec import LayerCacheSpec, has_state
from hetserve.kv.paged import KVCacheSpec, PagedKVCache
from hetserve.kv.state_slots import StateSlots


def resolve_model_dir(model: str | None) -> Path:
    """The model directory a config names; None is the embedded demo model (built on first
    use under HETSERVE_CACHE)."""
    if model is None:
        from hetserve.testing.tiny import demo_model_dir

        return Path(demo_model_dir())
    return Path(model)


def state_slots(cfg: EngineConfig, specs: list[LayerCacheSpec]) -> StateSlots | None:
    """The state slots of a model with linear-attention layers (None without such layers):
    one per running request, plus the prefix checkpoints' while prefix caching is on."""
    if not has_state(specs):
        return None
    c, seqs = cfg.cache, cfg.scheduler.max_num_seqs
    ckpts = (seqs if c.state_checkpoints is None else c.state_checkpoints) * int(
        c.enable_prefix_caching
    )
    return StateSlots(seqs, ckpts, c.state_checkpoint_every)


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


def graph_options(cfg: EngineConfig, model: torch.nn.Module, max_model_len: int):
    """Decode graphs for the runner: on CUDA unless `--enforce-eager`; None on CPU (the eager
    path is the same computation without the padding) and where the model has no parameter on
    CUDA. Buckets reach the scheduler's max_num_seqs; contexts its max_model_len."""
    from hetserve.engine.runner import GraphOptions

    device = next(model.parameters()).device
    if cfg.enforce_eager or device.type != "cuda":
        return None
    max_blocks = -(-max_model_len // cfg.cache.block_size)
    return GraphOptions(cfg.scheduler.max_num_seqs, max_blocks, capture=True)
