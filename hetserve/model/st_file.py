"""One safetensors file read tensor by tensor with plain reads, no mmap.

Who calls it: the checkpoint stream (model/checkpoint.py) and the converted-experts reader
(model/converted.py). Why not `safetensors.safe_open`: it maps the whole file, and every page a
tensor was copied from stays in the process's resident set until the file is closed, so
reading a shard doubled its bytes in RSS until the shard ended (a 795 MB fp32 checkpoint
peaked at 1.9 GB). Here each tensor is read straight into its own buffer (`readinto`), so the
only copy is the one the caller keeps; or, for a caller that copies or rounds each tensor
before it asks for the next, into one reused buffer (`Scratch`). Failure: a header that does
not parse or a tensor that runs past the end of the file is a `ModelLoadError` naming the file.
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


class Scratch:
    """One read buffer reused tensor after tensor, for a reader that is done with each tensor
    before it reads the next (the loader: it copies each into its parameter or rounds it to
    int8). A fresh buffer per tensor left a dense checkpoint's load with freed reads scattered
    through the C heap (the 1.7 B MoE's fp32 safetensors: peak 2125-2656 MiB over 1878
    resident, run to run; 2095-2198 reused, and its 6.8 GB of reads no longer allocate).
    Tensors from 1 MiB (smaller ones are cheap to allocate) up to 64 MiB (a larger one, a big
    vocabulary's embeddings, would keep its size held for the rest of the load)."""

    LOW, HIGH = 1 << 20, 64 << 20

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor | None:
        """`nbytes` of the buffer (grown as needed), or None outside the rule."""
        if not self.LOW <= nbytes <= self.HIGH:
            return None
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = None  # the old one goes before the larger one is made
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._buf[:nbytes]


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

    def read(self, name: str, scratch: Scratch | None = None) -> torch.Tensor:
        """Tensor `name`; in `scratch`'s buffer where given and the tensor fits its rule (the
        result is then overwritten by the next read into it)."""
        info = self._info[name]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ModelLoadError(f"{self.path.name}: tensor {name!r} has dtype {info['dtype']}")
        begin, end = (int(x) for x in info["data_offsets"])
        shape = [int(d) for d in info["shape"]]
        held = None if scratch is None else scratch.take(end - begin)
        out = torch.empty(shape, dtype=dtype) if held is None else held.view(dtype).view(shape)
        raw = out.view(-1).view(torch.uint8) if out.numel() else out.view(torch.uint8)
        if raw.numel() != end - begin:
            raise ModelLoadError(f"{self.path.name}: tensor {name!r}: shape and size disagree")
        self._f.seek(self._start + begin)
        got = self._f.readinto(memoryview(raw.numpy()).cast("B")) if raw.numel() else 0
        if got != end - begin:
            raise ModelLoadError(f"{self.path.name}: tensor {name!r} runs past the end of file")
        return out


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata=None) -> None:
    """`safetensors.torch.save_file`, the file then readable as any other the user writes (it
    creates 0600 files: a model directory shared with others, or served by another user,
    could not be read)."""
    import os

    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    mask = os.umask(0o022)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
