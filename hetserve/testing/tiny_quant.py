"""Quantized tiny checkpoints, written exactly as each publisher's format specifies, from a tiny
fp32 checkpoint (testing/tiny.py): tensor names, dtypes, shapes and config keys as in
DeepSeek-V3's FP8 release, gpt-oss's MXFP4 experts, AutoGPTQ's 4-bit layout and Kimi-K2
Thinking's compressed-tensors pack-quantized experts.

`write_quantized` also writes the reference: the same model with every quantized weight replaced
by the exact values it stands for (fp32, no quantization_config), so a test can hold the loaded
quantized model against the model those numbers define.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from hetserve.errors import InvalidInputError
from hetserve.model.st_file import save_safetensors
from hetserve.quant.quantize import (
    dequantize_fp8_blocks,
    dequantize_mxfp4,
    quantize_fp8_blocks,
    quantize_mxfp4,
)

# Which weights each publisher quantizes.
# Linear weights: *_proj, Mixtral-named experts (MiniMax-M2) and V3.2's indexer projections.
_LINEAR = re.compile(r"^model\.layers\.\d+\..*(_proj|experts\.\d+\.w[123]|\.wq_b|\.wk)\.weight$")
_ROUTED = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
_GPT_OSS_EXPERTS = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")

CONFIGS = {
    "fp8": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    },
    "mxfp4": {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    },
    "gptq": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "desc_act": False,
        "sym": True,
        "static_groups": False,
        "true_sequential": True,
        "damp_percent": 0.01,
        "checkpoint_format": "gptq",
    },
    "compressed-tensors": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": None,
                "output_activations": None,
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "strategy": "group",
                    "group_size": 32,
                    "symmetric": True,
                    "dynamic": False,
                    "actorder": None,
                    "observer": "minmax",
                },
            }
        },
        "ignore": [
            "lm_head",
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        ],
        "kv_cache_scheme": None,
    },
}


def _pack_words(q: torch.Tensor) -> torch.Tensor:
    """int values [.., M] in [0, 15] -> int32 [.., M/8], element 8m + i in nibble i."""
    q = q.to(torch.int64).reshape(*q.shape[:-1], -1, 8)
    words = (q << torch.arange(0, 32, 4)).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _fp8(name: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    q, scale = quantize_fp8_blocks(w)
    return {name: q, f"{name}_scale_inv": scale}, dequantize_fp8_blocks(q, scale, (128, 128))


def _gptq(name: str, w: torch.Tensor, group: int = 32) -> tuple[dict, torch.Tensor]:
    """Symmetric 4-bit GPTQ (v1 layout: zero stored minus one), fp16 scales."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    scale = (2 * wg.abs().amax(dim=2) / 15).clamp(min=1e-8).half().float()  # [N, G]
    q = torch.clamp(torch.round(wg / scale[..., None]) + 8, 0, 15).reshape(n, k)
    base = name[: -len(".weight")]
    zeros = torch.full((k // group, n), 7)  # zero 8, stored as 8 - 1
    parts = {
        # [K/8, N]: word (m, n) holds inputs 8m .. 8m + 7 of output n
        f"{base}.qweight": _pack_words(
            q.t().reshape(k // 8, 8, n).transpose(1, 2).reshape(k // 8, -1)
        ),
        f"{base}.qzeros": _pack_words(zeros),
        f"{base}.scales": scale.t().contiguous().half(),
        f"{base}.g_idx": torch.arange(k, dtype=torch.int32) // group,
    }
    return parts, ((q.reshape(n, -1, group) - 8) * scale[..., None]).reshape(n, k)


def _compressed(name: str, w: torch.Tensor, group: int = 32) -> tuple[dict, torch.Tensor]:
    """compressed-tensors pack-quantized, symmetric int4 groups (value + 8 in each nibble)."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group, group)
    scale = (wg.abs().amax(dim=2) / 7.5).clamp(min=1e-8).bfloat16()
    q = torch.clamp(torch.round(wg / scale.float()[..., None]), -8, 7).reshape(n, k)
    base = name[: -len(".weight")]
    parts = {
        f"{base}.weight_packed": _pack_words(q + 8),
        f"{base}.weight_scale": scale,
        f"{base}.weight_shape": torch.tensor([n, k], dtype=torch.int32),
    }
    return parts, (q.reshape(n, -1, group) * scale.float()[..., None]).reshape(n, k)


def _mxfp4(name: str, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """gpt-oss experts: the HF parameter is [E, in, out]; blocks run along the input."""
    blocks, scales = quantize_mxfp4(w.transpose(1, 2))
    return (
        {f"{name}_blocks": blocks, f"{name}_scales": scales},
        dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous(),
    )


_WRITERS = {
    "fp8": (_LINEAR, _fp8),
    "mxfp4": (_GPT_OSS_EXPERTS, _mxfp4),
    "gptq": (_LINEAR, _gptq),
    "compressed-tensors": (_ROUTED, _compressed),
}


def write_quantized(src: str | Path, out: str | Path, method: str, reference: str | Path) -> Path:
    """`src` (a tiny fp32 checkpoint) quantized with `method` into `out`, and the exact fp32
    model those numbers stand for into `reference`."""
    if method not in _WRITERS:
        raise InvalidInputError(f"method must be one of {sorted(_WRITERS)}, got {method!r}")
    src, out, reference = Path(src), Path(out), Path(reference)
    pattern, quantize = _WRITERS[method]
    quant, ref = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        # Routers stay unquantized, and so does V3.2's indexer head weighting (weights_proj:
        # transformers keeps it in fp32).
        skip = name.endswith(("mlp.gate.weight", "mlp.router.weight", "weights_proj.weight"))
        if pattern.match(name) and not skip:
            parts, ref[name] = quantize(name, t)
            quant.update(parts)
        else:
            quant[name] = ref[name] = t
    cfg = json.loads((src / "config.json").read_text())
    for path, tensors, qc in ((out, quant, CONFIGS[method]), (reference, ref, None)):
        path.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy2(f, path / f.name)
        config = {**cfg, "quantization_config": qc} if qc else cfg
        (path / "config.json").write_text(json.dumps(config, indent=2))
        contiguous = {k: v.contiguous() for k, v in tensors.items()}
        save_safetensors(contiguous, str(path / "model.safetensors"), metadata={"format": "pt"})
    return out
