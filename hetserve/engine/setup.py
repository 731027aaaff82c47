"""What the engine is built from before its first step: the model directory (the embedded demo
model by default), the context length, the state slots and the decode graphs (the KV cache's
size: `kv/sizing.py`).

Called by `EngineCore.__init__` (and by benchmarks that load the same checkpoint into a peer).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from hetserve.config import EngineConfig
from hetserve.kv.cache_spec import LayerCacheSpec, has_state
from hetserve.kv.state_slots import StateSlots


def resolve_model_dir(model: str | None) -> Path:
    """The model directory a config names; None is the embedded demo model (built on first
    use under HETSERVE_CACHE)."""
    if model is None:
        from hetserve.testing.tiny import demo_model_dir

        return Path(demo_model_dir())
    return Path(model)


log = logging.getLogger(__name__)


def context_length(requested: int | None, model_max: int) -> int:
    """The engine's max_model_len: the one asked for, never past the model's context (a
    warning names both where it was: vLLM refuses it, configs that ask for more keep working)."""
    if requested and requested > model_max:
        log.warning(
            "max_model_len %d is past the model's context (max_position_embeddings %d); "
            "serving %d tokens", requested, model_max, model_max,
        )  # fmt: skip
    return min(requested or model_max, model_max)


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
