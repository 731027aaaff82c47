"""Checkpoint quantization formats: `checkpoint_format(qc)` takes a checkpoint's
`quantization_config` (or `compression_config`; None when it has neither) and returns who
interprets the stored tensors (`base.CheckpointFormat`); a method it does not know is a one-line
ModelLoadError naming it and the supported ones."""

from __future__ import annotations

from hetserve.errors import ModelLoadError
from hetserve.quant.checkpoint.base import SUPPORTED, CheckpointFormat
from hetserve.quant.checkpoint.compressed import CompressedTensorsFormat
from hetserve.quant.checkpoint.fp8 import Fp8Format
from hetserve.quant.checkpoint.gptq import GptqFormat
from hetserve.quant.checkpoint.mxfp4 import Mxfp4Format

_METHODS: dict[str, type[Fp8Format | Mxfp4Format | GptqFormat | CompressedTensorsFormat]] = {
    "fp8": Fp8Format,
    "mxfp4": Mxfp4Format,
    "gptq": GptqFormat,
    "compressed-tensors": CompressedTensorsFormat,
}

__all__ = ["CheckpointFormat", "checkpoint_format"]


def checkpoint_format(qc: object) -> CheckpointFormat:
    if qc is None:
        return CheckpointFormat()
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    cls = _METHODS.get(method) if isinstance(method, str) else None
    if cls is None or not isinstance(qc, dict):
        raise ModelLoadError(
            f"quantization_config.quant_method {method!r} is not supported ({SUPPORTED})"
        )
    return cls.from_config(dict(qc))
