"""Random LoRA adapters in PEFT's format for any supported checkpoint (tests, benchmarks).

`write_random_adapter` writes what `PeftModel.save_pretrained` writes: PEFT's own LoraConfig
writes adapter_config.json and the weights carry PEFT's names, on any linear our model classes
have (including ones PEFT would map elsewhere on transformers 5 MoE models, e.g. shared experts).
Needs `peft` (hetserve[finetune]).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from hetserve.errors import InvalidInputError
from hetserve.model.st_file import save_safetensors

PREFIX = "base_model.model."  # PeftModel's prefix of the base model's names


def linear_shapes(model_dir: str | Path) -> dict[str, tuple[int, int]]:
    """Module name -> (in, out) of every linear of the model but the LM head."""
    from hetserve.model.config import ModelConfig
    from hetserve.model.registry import model_class

    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    return {
        name: (m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name != "lm_head"
    }


def write_random_adapter(
    model_dir: str | Path,
    out: str | Path,
    match: str = r"self_attn",
    rank: int = 4,
    alpha: float = 8,
    seed: int = 0,
    std: float = 0.1,
    **config,
) -> Path:
    """A PEFT LoRA adapter on every linear whose name matches `match` (re.search)."""
    import peft
    from peft.utils.other import get_pattern_key

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    pattern = config.get("rank_pattern") or {}
    state, leaves = {}, set()
    for name, (fan_in, fan_out) in linear_shapes(model_dir).items():
        if not re.search(match, name):
            continue
        r = pattern.get(get_pattern_key(pattern.keys(), name), rank)
        state[f"{PREFIX}{name}.lora_A.weight"] = torch.randn(r, fan_in, generator=g) * std
        state[f"{PREFIX}{name}.lora_B.weight"] = torch.randn(fan_out, r, generator=g) * std
        if config.get("use_dora"):
            mag = 1.0 + 0.1 * torch.randn(fan_out, generator=g)
            state[f"{PREFIX}{name}.lora_magnitude_vector"] = mag
        leaves.add(name.rpartition(".")[2])
    if not state:
        raise InvalidInputError(f"{match!r} matches no linear module of {model_dir}")
    save_safetensors(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=sorted(leaves), task_type="CAUSAL_LM", **config
    )
    cfg.save_pretrained(str(out))
    return out
