"""The kernel-layout experts file that `hetserve convert` writes (`model/convert.py`) and the
loader maps (`model/kernel_file.py`): each routed-experts module's weights as the native CPU
kernels hold them (`moe/cpu_native.py`: padded sizes, row quads interleaved, gate and up paired,
group parameters in their tiles), so serving it reads the bytes in place, with no copy.

Layout of the file (little-endian):

    [0, 24)       magic b"HSKLAYOUT\\0", u16 0, u64 offset and u32 length of the JSON header
    [64, ...)     the JSON header, in pages reserved before the data (after the data where it
                  outgrew them): a truncated file still names what it lost
    [R, end)      tensors (R: a page multiple): each module starts on a page (4096 B), each
                  tensor on 64 B

The header names the format (`"format": "hetserve-kernel-layout"`), `version` (LAYOUT_VERSION:
the byte order the kernels read; bumped whenever cpu_native.py's layout changes), the quant
(`int8` / `int4`), the kernel format number and group size, the ISA of the writer's kernels
(information only: every ISA build reads the same layout), and per module its sizes, padded
sizes and tensors (dtype, shape, offset, bytes, xxh3-64 digest; CRC-32 in older files).
Since 2026-11-28 the header may also hold `linears`: the dense linears the all-int8 placement
serves on the native int8 kernel (attention, shared experts, lm_head: layers/int8_linear.py),
each as that kernel reads it (`LinearLayout`: rows in quads, fp32 scales per row; a kept-precise
projection's int8 residual as more rows), named by the Int8Linear's module path after fusion
(`model.layers.0.self_attn.qkv_proj`), with the dtype its numbers were rounded from. Readers
before it ignore the key; files before it have none (their linears are read from the
safetensors file and rounded at load, as before).

Pure: this module validates headers and plans offsets; it reads and writes no files. A header
that does not parse, names another version, or puts a tensor outside the file is a
ModelLoadError of one line naming the file (and the tensor) and what to do.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

from hetserve.errors import InvalidInputError, ModelLoadError

MAGIC = b"HSKLAYOUT\0"
PREFIX = struct.Struct("<10sHQI")  # magic, reserved, header offset, header length
LAYOUT_VERSION = 1
FORMAT = "hetserve-kernel-layout"
PAGE = 4096
ALIGN = 64  # a cache line: the kernels' vector loads of a row never straddle two
FIELDS = ("w13", "s13", "w2", "s2")  # the kernel's four weight pointers (None -> NULL)
SUFFIX = ".hsk"

_DTYPES = {
    "int8": torch.int8,
    "uint8": torch.uint8,
    "float16": torch.float16,
    "float32": torch.float32,
}


@dataclass(frozen=True)
class KernelLayout:
    """One routed-experts module as the native kernels read it: `tensors` are w13, s13, w2, s2
    (None where the format carries its scales inside the weights) at `padded` (hidden,
    intermediate) sizes; `fmt` and `group_size` are the kernel's F_* number and G."""

    fmt: int
    group_size: int
    num_experts: int
    hidden: int
    inter: int
    padded: tuple[int, int]
    tensors: tuple[torch.Tensor | None, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if t is not None)


@dataclass(frozen=True)
class LinearLayout:
    """One Int8Linear as the native kernel (hetserve_qlinear) reads it: `w` int8 rows in quads
    ([rows padded to 4 / 4, padded in_features / 16, 4, 16]), `scale` fp32 per row (zero on
    padded rows); `rows` is out_features, or twice it where each row keeps its int8 rounding
    error as a second row (a kept-precise projection). `fmt` / `group`: the kernel's F_* number
    and columns per scale (0: per row)."""

    fmt: int
    group: int
    in_features: int
    out_features: int
    rows: int
    w: torch.Tensor
    scale: torch.Tensor


LINEAR_FIELDS = ("w", "scale")


def linear_entry(lay: LinearLayout, tensors: list[dict[str, Any]], dtype: str) -> dict[str, Any]:
    """`dtype`: what the linear's numbers were rounded from (the loader uses the layout only
    where it would round the same weights: a model in that dtype)."""
    return {"fmt": lay.fmt, "group": lay.group, "in": lay.in_features, "out": lay.out_features,
            "rows": lay.rows, "dtype": dtype, "tensors": tensors}  # fmt: skip


def check_format(lay: KernelLayout, fmt: int, group: int) -> None:
    """Refuses (one line) serving `lay` with a native backend of kernel format `fmt` and
    groups of `group` (0: the backend's default) that would have laid it out otherwise."""
    if lay.fmt != fmt or (group and lay.group_size != group):
        raise InvalidInputError(
            f"the converted experts are kernel format {lay.fmt} with groups of "
            f"{lay.group_size}, this backend reads format {fmt}, groups of {group}; serve it "
            "with its own backend or re-run hetserve convert"
        )


def check_padding(lay: KernelLayout, padded: tuple[int, int]) -> None:
    """Refuses `lay` where this build's kernels pad its sizes otherwise (hetserve_moe_padded)."""
    if tuple(lay.padded) != tuple(padded):
        raise ModelLoadError(
            f"the converted experts are padded to {tuple(lay.padded)}, this build's kernels "
            f"pad to {tuple(padded)}; re-run hetserve convert"
        )


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"no kernel-layout dtype for {dtype}")


def tensor_entry(name: str, t: torch.Tensor, offset: int, xxh3: int) -> dict[str, Any]:
    """`xxh3`: the tensor's bytes' xxh3-64 digest (files written before 2026-11-26 carry a
    `crc32` instead; the reader checks whichever is there)."""
    return {"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
            "offset": offset, "nbytes": t.nbytes, "xxh3": xxh3}  # fmt: skip


def module_entry(layout: KernelLayout, tensors: list[dict[str, Any] | None]) -> dict[str, Any]:
    return {"fmt": layout.fmt, "group_size": layout.group_size,
            "num_experts": layout.num_experts, "hidden": layout.hidden, "inter": layout.inter,
            "padded": list(layout.padded), "tensors": tensors}  # fmt: skip


def encode_prefix(header_offset: int, header_len: int) -> bytes:
    return PREFIX.pack(MAGIC, 0, header_offset, header_len)


def parse_prefix(raw: bytes, file_size: int, where: str) -> tuple[int, int]:
    """(header offset, header length) from the file's first bytes."""
    if len(raw) < PREFIX.size or raw[: len(MAGIC)] != MAGIC:
        raise ModelLoadError(
            f"{where} is not a hetserve kernel-layout file; re-run hetserve convert"
        )
    _, _, offset, length = PREFIX.unpack(raw[: PREFIX.size])
    if offset < PREFIX.size or offset + length > file_size or length == 0:
        raise ModelLoadError(
            f"{where} is truncated (its header lies past the end); re-run hetserve convert"
        )
    return offset, length


def parse_header(raw: bytes, file_size: int, where: str) -> dict[str, Any]:
    """The header, checked: format, version, and every tensor inside the data region."""
    try:
        header = json.loads(raw.decode("utf-8"))
        modules = header["modules"]
        fmt, version = header["format"], header["version"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise ModelLoadError(f"{where}: header is corrupt; re-run hetserve convert") from None
    if fmt != FORMAT:
        raise ModelLoadError(f"{where}: format {fmt!r} is not {FORMAT!r}; re-run hetserve convert")
    if version != LAYOUT_VERSION:
        raise ModelLoadError(
            f"{where} holds kernel layout version {version}, this hetserve reads version "
            f"{LAYOUT_VERSION}; re-run hetserve convert on the original checkpoint"
        )
    try:
        linears = header.get("linears", {})
        entries = [(name, t) for name, mod in modules.items() for t in mod["tensors"]]
        entries += [(name, t) for name, lin in linears.items() for t in lin["tensors"]]
        ok = all(isinstance(lin[k], int) for lin in linears.values()
                 for k in ("fmt", "group", "in", "out", "rows"))  # fmt: skip
        ok = ok and all(isinstance(lin["dtype"], str) and len(lin["tensors"]) == 2
                        for lin in linears.values())  # fmt: skip
    except (AttributeError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ModelLoadError(f"{where}: header is corrupt; re-run hetserve convert")
    for name, t in entries:
        if t is not None:
            _check_tensor(name, t, file_size, where)
    return dict(header)


def _check_tensor(module: str, t: dict[str, Any], file_size: int, where: str) -> None:
    if not isinstance(t, dict):
        raise ModelLoadError(f"{where}: {module!r} has a corrupt entry; re-run hetserve convert")
    name = f"{module}.{t.get('name')}"
    dtype = _DTYPES.get(t.get("dtype", ""))
    numel = 1
    for d in t.get("shape", []):
        numel *= int(d)
    size = numel * (torch.empty((), dtype=dtype).element_size() if dtype is not None else 0)
    offset, nbytes = int(t.get("offset", -1)), int(t.get("nbytes", -1))
    if dtype is None or size != nbytes or offset < PAGE or offset % ALIGN:
        raise ModelLoadError(
            f"{where}: tensor {name!r} has a corrupt entry; re-run hetserve convert"
        )
    if offset + nbytes > file_size:
        raise ModelLoadError(
            f"{where}: tensor {name!r} lies past the end of the file ({offset + nbytes} > "
            f"{file_size} bytes): the file is truncated; re-run hetserve convert"
        )


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]
