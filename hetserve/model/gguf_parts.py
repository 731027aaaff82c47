"""Opening a GGUF model's file or files: split models (`name-00001-of-00003.gguf`, as
llama.cpp's gguf-split and convert_hf_to_gguf's --split-max-* write them) from their first part,
and files cut short or damaged, refused in one line that names the tensor.

`release_pages` lets go of a tensor's mapped pages once the loader has taken what it needs from
them: the file's pages otherwise stay in the process's resident set beside the copies made
from them, and a load would peak at twice the file.

Who calls it: `GgufCheckpoint` (model/gguf_file.py). Failure: a missing part is a
ModelNotFoundError naming it; a later part given instead of the first, a tensor whose bytes run
past the end of its file or of an unknown type, or an unreadable header, a ModelLoadError.
"""

from __future__ import annotations

import mmap
import re
from pathlib import Path
from typing import Any

import numpy as np

from hetserve.errors import ModelLoadError, ModelNotFoundError

_PART = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def _checked_reader(gguf: Any) -> type:
    class CheckedReader(gguf.GGUFReader):  # type: ignore[misc,name-defined]
        """gguf's reader, which checks every tensor's type and extent before mapping it."""

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            size = len(self.data)
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                name = bytes(name).decode("utf-8", "replace")
                try:
                    kind = gguf.GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise ValueError(
                        f"tensor {name!r} has unknown type id {int(raw_type[0])}"
                    ) from None
                n = 1
                for d in dims.tolist():
                    n *= int(d)
                block, type_size = gguf.GGML_QUANT_SIZES[kind]
                end = int(start_offs + offset[0]) + n * type_size // block
                if end > size:
                    raise ValueError(
                        f"tensor {name!r} ({kind.name}) needs bytes up to {end} but the file "
                        f"ends at {size}: the file is truncated"
                    )
            super()._build_tensors(start_offs, fields)

    return CheckedReader


def open_reader(gguf: Any, path: Path) -> Any:
    try:
        return _checked_reader(gguf)(str(path))
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from None


def open_parts(gguf: Any, path: Path) -> list[Any]:
    """Readers of every part of the model `path` starts (one for a single file); the first
    holds the metadata."""
    first = open_reader(gguf, path)
    count_field = first.fields.get("split.count")
    count = 1 if count_field is None else int(count_field.contents())
    if count <= 1:
        return [first]
    m = _PART.match(path.name)
    no = first.fields.get("split.no")
    if m is None or (no is not None and int(no.contents()) != 0):
        raise ModelLoadError(
            f"{path} is part of a split GGUF model ({count} parts); pass its first part, "
            "NAME-00001-of-NNNNN.gguf"
        )
    readers = [first]
    for i in range(2, count + 1):
        part = path.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf")
        if not part.is_file():
            raise ModelNotFoundError(f"split GGUF model: part {part} is missing")
        readers.append(open_reader(gguf, part))
    return readers


# A read fault maps the pages around it too (Linux's fault-around, 64 KiB by default): a tensor's
# pages are let go with that much on either side.
_AROUND = max(64 << 10, mmap.PAGESIZE)


def release_pages(parts: list[Any], data: Any) -> None:
    """Drop the pages of `data` (a tensor's bytes, a view into one of the parts' mappings, or a
    whole mapping) from this process's resident set. They are the file's clean pages, so a later
    read of them (a view something kept, a neighbouring tensor) maps them in again from the page
    cache: only memory use changes."""
    addr = int(data.ctypes.data)
    for reader in parts:
        mapped = reader.data
        # read-only mappings of the whole file only: dropping a copy-on-write page would lose
        # what was written, and an offset mapping's pages do not start at its data
        ok = isinstance(mapped, np.memmap) and mapped.mode == "r" and mapped.offset == 0
        buf = getattr(mapped, "_mmap", None) if ok else None
        base, size = int(mapped.ctypes.data), mapped.nbytes
        if buf is None or not base <= addr < base + size:
            continue
        start = max(addr - base - _AROUND, 0) // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(addr - base + data.nbytes + _AROUND, size)
        if end > start:
            buf.madvise(mmap.MADV_DONTNEED, start, end - start)
        return
