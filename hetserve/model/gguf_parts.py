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
    value_type = gguf.GGUFValueType

    class ArrayField(gguf.ReaderField):  # type: ignore[misc,name-defined]
        """An array field holding its values (in `data`: a list of strings, or a numpy array of
        numbers), read in one pass; `contents` as gguf's own."""

        def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
            got = self.data[index_or_slice]
            return got.tolist() if isinstance(got, np.ndarray | np.generic) else got

    class CheckedReader(gguf.GGUFReader):  # type: ignore[misc,name-defined]
        """gguf's reader, which checks every tensor's type and extent before mapping it, and
        reads arrays of strings (a vocabulary's 150-200k tokens and its merges) in one pass
        over the bytes: gguf's own reader makes numpy views per string, 17 s a file of 201k
        tokens here, read twice per load."""

        def _build_fields(self, offs: int, count: int) -> int:
            view = memoryview(self.data)
            for _ in range(count):
                key_len = int.from_bytes(view[offs : offs + 8], "little")
                kind = int.from_bytes(view[offs + 8 + key_len : offs + 12 + key_len], "little")
                start = offs + 12 + key_len
                item = int.from_bytes(view[start : start + 4], "little")
                number = self.gguf_scalar_to_np.get(value_type(item)) if item < 13 else None
                fast = item == value_type.STRING or number is not None
                if kind != value_type.ARRAY or not fast or self.byte_order != "I":
                    offs = super()._build_fields(offs, 1)  # one field the ordinary way
                    continue
                n = int.from_bytes(view[start + 4 : start + 12], "little")
                at = start + 12
                values: Any
                if number is not None:
                    values = np.frombuffer(self.data, dtype=number, count=n, offset=at)
                    at += values.nbytes
                else:
                    values = []
                    for _ in range(n):
                        length = int.from_bytes(view[at : at + 8], "little")
                        if at + 8 + length > len(view):
                            raise ValueError(f"metadata at byte {offs} runs past the end")
                        values.append(str(view[at + 8 : at + 8 + length], "utf-8"))
                        at += 8 + length
                name = str(view[offs + 8 : offs + 8 + key_len], "utf-8")
                types = [value_type.ARRAY, value_type(item)]
                self._push_field(ArrayField(offs, name, [], values, types), skip_sum=True)
                offs = at
            return offs

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
    except IndexError:  # gguf's reader indexing an empty slice past the end of the map
        raise ModelLoadError(
            f"{path} is not a readable GGUF file: its header (metadata and tensor list) runs "
            "past the end of the file; the file is truncated or corrupt"
        ) from None
    except (ValueError, OSError, KeyError) as exc:
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
    if m is None and (no is None or int(no.contents()) == 0):
        raise ModelLoadError(
            f"{path} is the first part of a split GGUF model ({count} parts), renamed: its "
            f"parts are found by name; keep the names NAME-00001-of-{count:05d}.gguf, ..."
        )
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
