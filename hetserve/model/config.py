"""ModelConfig: the fields every family needs, read once from an HF config.json.

Family-specific keys (MoE, MLA) are read by the family's constructor through `get`, which
accepts the aliases different transformers versions wrote.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from hetserve.errors import ModelLoadError, ModelNotFoundError
from hetserve.layers.rotary import RopeConfig


@dataclass(frozen=True, eq=False)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    hidden_act: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    hf: Mapping

    def get(self, *keys: str, default=None):
        """First present, non-null value among `keys` (aliases), else `default`."""
        for key in keys:
            value = self.hf.get(key)
            if value is not None:
                return value
        return default

    def require(self, *keys: str):
        value = self.get(*keys)
        if value is None:
            raise ModelLoadError(f"config.json lacks {keys[0]!r}, which {self.architecture} needs")
        return value

    def partial_rotary_dim(self, default_factor: float) -> int:
        """Rotated channels per head for a family that rotates a share of each head:
        `rope_parameters.partial_rotary_factor` wins over the top-level key (where published
        configs put it), as in transformers; `default_factor` where neither is given."""
        factor = self.rope.get("partial_rotary_factor")
        if factor is None:
            factor = self.get("partial_rotary_factor", default=default_factor)
        dim = int(self.head_dim * float(factor))
        if dim < 2 or dim % 2 or dim > self.head_dim:
            raise ModelLoadError(
                f"partial_rotary_factor={factor} gives {dim} rotary channels of head_dim "
                f"{self.head_dim}; it must give an even number in [2, head_dim]"
            )
        return dim

    @classmethod
    def from_dict(cls, hf: dict) -> ModelConfig:
        archs = hf.get("architectures") or []
        if not archs:
            raise ModelLoadError("config.json has no 'architectures' list; add the HF class name")
        text = hf.get("text_config")
        if isinstance(text, dict) and "hidden_size" not in hf:
            # A vision-language checkpoint served as text (Qwen3.5-MoE as published): the text
            # model's keys, under the checkpoint's architecture.
            hf = {**hf, **text, "architectures": archs}
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            head_dim = hf.get("head_dim") or (hidden // heads if heads > 0 else 0)
            eos = hf.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            cfg = cls(
                architecture=archs[0],
                model_type=hf.get("model_type", ""),
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                intermediate_size=int(hf.get("intermediate_size") or 0),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                rope=RopeConfig.from_hf(hf),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                hidden_act=hf.get("hidden_act", "silu"),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
                hf=MappingProxyType(dict(hf)),
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json lacks required key {exc.args[0]!r}") from None
        except (TypeError, ValueError, ArithmeticError) as exc:
            raise ModelLoadError(f"config.json has a value that is not a number: {exc}") from None
        cfg._check()
        return cfg

    def _check(self) -> None:
        """Sizes a model can be built from (a checkpoint's own config.json is not trusted)."""
        sizes = {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                 "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                 "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim}  # fmt: skip
        for key, value in sizes.items():
            if value < 1:
                raise ModelLoadError(f"config.json: {key} is {value}; it must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        experts = self.get("n_routed_experts", "num_experts", "num_local_experts")
        top_k = self.get("num_experts_per_tok")
        if isinstance(experts, int) and isinstance(top_k, int) and top_k > experts > 0:
            raise ModelLoadError(
                f"config.json: num_experts_per_tok ({top_k}) is more than the {experts} routed "
                "experts; each token picks at most every expert"
            )
        if self.max_position_embeddings < 2:
            raise ModelLoadError(
                f"config.json: max_position_embeddings is {self.max_position_embeddings}; "
                "it must be >= 2"
            )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        if not path.is_dir():
            raise ModelNotFoundError(
                f"model directory {str(path)!r} does not exist; pass a local HF model directory"
            )
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            # A GGUF model is its file (a split one's first part), not the folder holding it.
            ggufs = sorted(p.name for p in path.glob("*.gguf") if "-of-" not in p.name)
            ggufs += sorted(p.name for p in path.glob("*-00001-of-*.gguf"))
            if ggufs:
                raise ModelNotFoundError(
                    f"{str(path)!r} has no config.json but holds GGUF files; pass the file: "
                    f"--model {path / ggufs[0]}"
                )
            raise ModelNotFoundError(
                f"{str(path)!r} has no config.json; pass an HF model directory (config.json + "
                "*.safetensors)"
            )
        return cls.from_dict(read_config_json(cfg_file))


def read_config_json(path: Path) -> dict:
    """A checkpoint's config.json as a mapping; ModelLoadError naming the file where it is not
    valid JSON or not an object (every reader of a model directory goes through here)."""
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path} must hold a JSON object (the model's settings)")
    return cfg
