"""Fold a LoRA (or DoRA) adapter into a model's full weights.

The output is the base checkpoint with every adapted weight replaced by PEFT's merge of it
(`W + scale * B @ A`; DoRA: that, each output row rescaled to the trained magnitude) and
everything else copied byte for byte: the other tensors in the same shards under the same names,
the shard index, config.json, tokenizer and generation files. So transformers, `hetserve convert`
and `hetserve serve` read it as they read the base. Merging runs in fp32 and stores each weight
in its original dtype.

Why our own merge and not PEFT's `merge_and_unload`: that needs the transformers model in memory
(all of a huge MoE's experts), while this streams the checkpoint one shard at a time and never
touches the experts. Errors are one-line `ModelLoadError`/`InvalidInputError`s raised before
anything is written.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from hetserve.errors import InvalidInputError, ModelLoadError
from hetserve.model.config import read_config_json

if TYPE_CHECKING:  # `hetserve export` imports this lazily; torch only when it runs
    import torch

    from hetserve.model.lora_adapter import LoRAAdapter, LoRAWeights

_QUANTIZED_KEYS = ("quantization_config", "compression_config", "hetserve_experts")


def export_merged(
    model_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path, progress: bool = True
) -> Path:
    """Write the base model with the adapter merged into `out_dir`; returns it."""
    from safetensors import safe_open
    from tqdm import tqdm

    from hetserve.model.checkpoint import checkpoint_files
    from hetserve.model.lora_adapter import read_adapter
    from hetserve.model.st_file import save_safetensors

    src, out = Path(model_dir), Path(out_dir)
    _check_dirs(src, out)
    adapter = read_adapter(adapter_dir, allow_dora=True)
    files = checkpoint_files(src)
    where = _locate(adapter, files)
    total = sum(f.stat().st_size for f in files)
    out.mkdir(parents=True, exist_ok=True)
    with tqdm(total=total, unit="B", unit_scale=True, desc="merging", disable=not progress) as bar:
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                metadata = f.metadata()
                tensors = {name: f.get_tensor(name) for name in f.keys()}
            for name in where.get(path, ()):
                module = name.removesuffix(".weight")
                tensors[name] = merge_weight(tensors[name], adapter.modules[module], module)
            save_safetensors(tensors, str(out / path.name), metadata=metadata)
            bar.update(path.stat().st_size)
    for item in src.iterdir():  # config, index, tokenizer, generation config, ...
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy2(item, out / item.name)
    return out


def _check_dirs(src: Path, out: Path) -> None:
    if not (src / "config.json").is_file():
        raise ModelLoadError(f"{str(src)!r} has no config.json; give an HF model directory")
    cfg = read_config_json(src / "config.json")
    quantized = next((k for k in _QUANTIZED_KEYS if k in cfg), None)
    if quantized is not None:
        raise InvalidInputError(
            f"{src} is a quantized checkpoint ({quantized} in config.json); merge the adapter "
            "into the full-precision model and quantize the result"
        )
    require_new_dir(out, "--out")
    if out.resolve() == src.resolve():
        raise InvalidInputError("--out must differ from --model")


def require_new_dir(out: Path, flag: str) -> None:
    """A checkpoint's output directory must be new or empty: files of an earlier checkpoint left
    beside the new one (shards, an index) would be read with it. Also `models make-tiny` and
    `convert`'s."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InvalidInputError(
            f"{flag} {str(out)!r} exists and is not empty; give a new directory (or remove it "
            "first)"
        )


def _locate(adapter: LoRAAdapter, files: list[Path]) -> dict[Path, list[str]]:
    """Shard -> the weight names in it that the adapter changes; every adapted module's weight
    must be there, in a float dtype."""
    from safetensors import safe_open

    wanted = {f"{m}.weight" for m in adapter.modules}
    where: dict[Path, list[str]] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in wanted.intersection(f.keys()):
                dtype = f.get_slice(name).get_dtype()
                if dtype not in ("F32", "BF16", "F16", "F64"):
                    raise InvalidInputError(
                        f"{name} is stored as {dtype}; merge into a full-precision checkpoint"
                    )
                lora = adapter.modules[name.removesuffix(".weight")]
                _check_shape(tuple(f.get_slice(name).get_shape()), lora, name)
                where.setdefault(path, []).append(name)
    missing = wanted - {n for names in where.values() for n in names}
    if missing:
        module = sorted(missing)[0].removesuffix(".weight")
        raise ModelLoadError(
            f"LoRA adapter {str(adapter.path)!r} targets {module}, which the model's checkpoint "
            "does not have; was it trained for another model?"
        )
    return where


def merge_weight(weight: torch.Tensor, lora: LoRAWeights, name: str = "") -> torch.Tensor:
    """PEFT's merge of one linear's weight [out, in], computed in fp32."""
    import torch

    w = weight.float()
    _check_shape(tuple(w.shape), lora, name)
    delta = (lora.b @ lora.a) * lora.scale
    merged = w + delta
    if lora.magnitude is not None:  # DoRA: each output row rescaled to the trained magnitude
        merged = (lora.magnitude / torch.linalg.norm(merged, dim=1))[:, None] * merged
    return merged.to(weight.dtype).contiguous()


def _check_shape(weight: tuple[int, ...], lora: LoRAWeights, name: str) -> None:
    """Checked for every weight before the first shard is written (a mismatch found mid-way
    left a partial --out behind, which the next attempt then refused as not empty)."""
    delta = (lora.b.shape[0], lora.a.shape[1])
    if delta != weight:
        raise ModelLoadError(
            f"{name.removesuffix('.weight')}: the adapter's delta is {delta} but the weight is "
            f"{weight}; was it trained for another model?"
        )
