"""Checkpoint quantization formats: `checkpoint_format(config)` reads `quantization_config` and
returns who interprets the stored tensors (`base.CheckpointFormat`); a method it does not know
is a one-line ModelLoadError naming it and the supported ones."""

from __future__ import annotations

from hetserve.errors import ModelLoadError
from hetserve.model.config import ModelConfig
from hetserve.model.quant.base import SUPPORTED, CheckpointFormat
from hetserve.model.quant.compressed import CompressedTensorsFormat
from hetserve.model.quant.fp8 import Fp8Format
from hetserve.model.quant.gptq import GptqFormat
from hetserve.model.quant.mxfp4 import Mxfp4Format

_METHODS = {
    "fp8": Fp8Format,
    "mxfp4": Mxfp4Format,
    "gptq": GptqFormat,
    "compressed-tensors": CompressedTensorsFormat,
}

__all__ = ["CheckpointFormat", "checkpoint_format"]


def checkpoint_format(cfg: ModelConfig) -> CheckpointFormat:
    qc = cfg.get("quantization_config", "compression_config")
    if qc is None:
        return CheckpointFormat()
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    cls = _METHODS.get(method)
    if cls is None:
        raise ModelLoadError(
            f"quantization_config.quant_method {method!r} is not supported ({SUPPORTED})"
        )
    return cls.from_config(dict(qc))
