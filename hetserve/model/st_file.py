"""One safetensors file read tensor by tensor with plain reads, no mmap.

Who calls it: the checkpoint stream (model/checkpoint.py) and the converted-experts reader
(model/converted.py). Why not `safetensors.safe_open`: it maps the whole file, and every page a
tensor was copied from stays in the process's resident set until the file is closed, so
reading a shard doubled its bytes in RSS until the shard ended (a 795 MB fp32 checkpoint
peaked at 1.9 GB). Here each tensor is read straight into its own buffer (`readinto`), so the
only copy is the one the caller keeps. Failure: a header that does not parse or a tensor that
runs past the end of the file is a `ModelLoadError` naming the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from hetserve.errors import ModelLoadError

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 << 20  # safetensors' own limit


class SafetensorsFile:
    """Header parsed on open; `read(name)` returns a fresh CPU tensor with the stored bytes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._f = open(self.path, "rb")  # noqa: SIM115 (closed by close / the context manager)
        try:
            raw = self._f.read(8)
            (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (None,)
            if n is None or n > _MAX_HEADER:
                raise ValueError("bad header length")
            header = json.loads(self._f.read(n))
        except (ValueError, struct.error) as exc:
            self._f.close()
            raise ModelLoadError(f"{self.path.name}: not a safetensors file ({exc})") from None
        self._start = 8 + n
        header.pop("__metadata__", None)
        self._info: dict[str, dict] = header

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._f.close()

    def keys(self) -> list[str]:
        return sorted(self._info)  # safe_open's order: a layer's tensors come together

    def dtype(self, name: str) -> str:
        return str(self._info[name]["dtype"])

    def nbytes(self, name: str) -> int:
        begin, end = self._info[name]["data_offsets"]
        return int(end) - int(begin)

    def read(self, name: str) -> torch.Tensor:
        info = self._info[name]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelLoadError(f"{self.path.name}: tensor {name!r} has dtype {info['dtype']}")
        begin, end = (int(x) for x in info["data_offsets"])
        shape = [int(d) for d in info["shape"]]
        out = torch.empty(shape, dtype=dtype)
        raw = out.view(-1).view(torch.uint8) if out.numel() else out.view(torch.uint8)
        if raw.numel() != end - begin:
            raise ModelLoadError(f"{self.path.name}: tensor {name!r}: shape and size disagree")
        self._f.seek(self._start + begin)
        got = self._f.readinto(memoryview(raw.numpy()).cast("B")) if raw.numel() else 0
        if got != end - begin:
            raise ModelLoadError(f"{self.path.name}: tensor {name!r} runs past the end of file")
        return out
