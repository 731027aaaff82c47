"""Load an HF model directory into a family class: lazy (mmap) safetensors reads, name mapping,
shape checks, clear errors, a progress bar for large models.

Routed experts are accepted both as one tensor per expert (what checkpoints on disk hold:
`experts.{e}.gate_proj|up_proj|down_proj.weight`, Mixtral `experts.{e}.w1|w3|w2.weight`) and as
transformers' fused in-memory tensors (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from hetserve.errors import MissingTensorError, ModelLoadError, TensorShapeError
from hetserve.model.base import CausalLM
from hetserve.model.config import ModelConfig
from hetserve.model.converted import CONFIG_KEY, load_converted_experts
from hetserve.model.registry import model_class

log = logging.getLogger(__name__)

_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Which half of w13 (0 = gate, 1 = up) or w2 a per-expert tensor fills.
_PART = {
    "gate_proj": ("w13", 0),
    "w1": ("w13", 0),
    "up_proj": ("w13", 1),
    "w3": ("w13", 1),
    "down_proj": ("w2", None),
    "w2": ("w2", None),
}
PROGRESS_MIN_BYTES = 256 << 20


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ModelLoadError(f"unknown device {device!r}; use auto, cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but CUDA is not available; use --device cpu")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    # fp32 on CPU: bf16 matmul is ~100x slower than fp32 on AVX2 CPUs without AMX.
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in table:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return table[dtype]


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index.name} names missing shard(s) {missing}; re-download them")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors in {str(model_dir)!r}; convert the weights first")
    return files


class _Filler:
    """Maps checkpoint names onto parameters and tracks what has been filled."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.filled: set[str] = set()  # plain params, and "w13:e:half" / "w2:e" expert parts
        self.num_layers = model.config.num_layers

    def target(self, name: str) -> str | None:
        """Parameter-space name for a checkpoint name (after aliases), None to skip it."""
        m = _LAYER.match(name)
        if (m and int(m.group(1)) >= self.num_layers) or name.endswith("rotary_emb.inv_freq"):
            return None  # extra layers (DeepSeek's MTP module) and derived buffers
        candidates = [name] + [re.sub(p, r, name) for p, r in self.model.checkpoint_aliases]
        for cand in candidates:
            if cand in self.params:
                return cand
            for pattern in (_PER_EXPERT, _FUSED):
                em = pattern.match(cand)
                if em and f"{em.group(1)}.w13" in self.params:
                    return cand
        return None

    def fill(self, name: str, tensor: torch.Tensor, ckpt_name: str) -> None:
        em = _PER_EXPERT.match(name)
        if em:
            prefix, e, part = em.group(1), int(em.group(2)), em.group(3)
            pname, half = _PART[part]
            param = self.params[f"{prefix}.{pname}"]
            if e >= param.shape[0]:
                raise TensorShapeError(
                    f"tensor {ckpt_name!r} names expert {e}, but the config has {param.shape[0]}"
                )
            dst = param.data[e]
            if half is not None:
                inter = param.shape[1] // 2
                dst = dst[half * inter : (half + 1) * inter]
            self._copy(dst, tensor, ckpt_name)
            self.filled.add(f"{prefix}.{pname}:{e}:{half}")
            return
        fm = _FUSED.match(name)
        if fm:
            pname = "w13" if fm.group(2) == "gate_up_proj" else "w2"
            name = f"{fm.group(1)}.{pname}"
        self._copy(self.params[name].data, tensor, ckpt_name)
        self.filled.add(name)

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, ckpt_name: str) -> None:
        if tuple(dst.shape) != tuple(src.shape):
            raise TensorShapeError(
                f"tensor {ckpt_name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}; "
                "the checkpoint does not match config.json"
            )
        dst.copy_(src)

    def check_complete(self, experts_elsewhere: bool = False) -> None:
        tied = self.model.config.tie_word_embeddings
        for name, param in self.params.items():
            if name in self.filled or (tied and name == "lm_head.weight"):
                continue
            if experts_elsewhere and name.rpartition(".")[2] in ("w13", "w2"):
                continue  # filled from the converted experts file
            prefix, _, pname = name.rpartition(".")
            if pname in ("w13", "w2") and prefix.endswith(".experts"):
                for e in range(param.shape[0]):
                    for half, part in ((0, "gate_proj"), (1, "up_proj"), (None, "down_proj")):
                        key = f"{name}:{e}:{half}"
                        if (pname == "w13") == (half is not None) and key not in self.filled:
                            raise MissingTensorError(
                                f"checkpoint lacks tensor '{prefix}.{e}.{part}.weight' "
                                "(or the fused experts tensor); the checkpoint is incomplete"
                            )
                continue
            raise MissingTensorError(
                f"checkpoint lacks tensor {name!r}; the checkpoint is incomplete or for "
                "another architecture"
            )


def load_model(
    model_dir: str | Path, device: str = "auto", dtype: str = "auto", placement=None
) -> CausalLM:
    """Load weights. With `placement` (a list of PlacementRule, or "default"), units are placed
    before any memory is allocated, so routed experts bound for the host never touch the
    accelerator; the plan is left on `model.hybrid_plan` for the expert backends."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    cls = model_class(cfg.architecture)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    files = checkpoint_files(model_dir)
    with torch.device("meta"):
        model = cls(cfg).to(dt)
    model.hybrid_plan = None
    if placement is not None:
        from hetserve.moe.hybrid import plan_placement

        rules = None if placement == "default" else placement
        plan = plan_placement(model, rules, dev)
        for name, unit in plan.units.items():
            unit.to_empty(device=plan.weight_device(name))
        model.hybrid_plan = plan
    else:
        model = model.to_empty(device=dev)
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers(dev)
    filler = _Filler(model)
    total = sum(f.stat().st_size for f in files)
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="loading weights",
        disable=total < PROGRESS_MIN_BYTES,
    ) as bar:
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    target = filler.target(name)
                    if target is None:
                        log.debug("skipping checkpoint tensor %s", name)
                        continue
                    tensor = f.get_tensor(name)
                    filler.fill(target, tensor, name)
                    bar.update(tensor.numel() * tensor.element_size())
    converted = cfg.get(CONFIG_KEY)
    filler.check_complete(experts_elsewhere=converted is not None)
    if converted is not None:
        load_converted_experts(model, model_dir, converted)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.eval().requires_grad_(False)
    if model.hybrid_plan is None:
        from hetserve.moe.experts import default_backend

        for _, experts in model.routed_experts():
            experts.set_backend(default_backend(experts.weights(), experts.activation))
    return model
