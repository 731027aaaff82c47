"""Writing and mapping the kernel-layout experts file (format: `quant/kernel_file.py`).

Who calls it: `hetserve convert` writes one (`KernelFileWriter`: the dense linears, then the
experts a module at a time, so conversion holds one layer), the loader maps one
(`MappedKernelFile`, model/converted.py) and hands each experts module's views to its native
backend and each dense linear's to its Int8Linear, which read them in place.

The mapping is read-only and shared (mmap ACCESS_READ: PROT_READ, MAP_SHARED), so its pages
are the page cache's: every process serving the file on this host shares one copy, a restart
finds them still cached, and the kernels cannot write into them (a stray write faults). Each
tensor's digest (xxh3-64; CRC-32 in files written before it) is checked when its module is
mapped (~12 GB/s on one core here from the page cache; from disk the check is the disk's read
of the whole file, ~3 s for the 1.6 GB of the 1.7 B MoE's experts on the dev VM); a mismatch,
a truncated file or a missing module is a ModelLoadError of one line naming the tensor. A file
whose every digest passed is remembered (`remember`, HETSERVE_VERIFY_CONVERTED's default):
a stamp under HETSERVE_CACHE/verified keyed by its path, device, inode, size, mtime and ctime,
so later loads map it without reading it (its pages are read as the kernels touch them, as
llama.cpp maps a GGUF), and any write to the file, which moves its mtime and ctime, asks for
the check again.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
import xxhash

from hetserve import envs
from hetserve.errors import MissingTensorError, ModelLoadError
from hetserve.quant.kernel_file import (
    ALIGN,
    FIELDS,
    LINEAR_FIELDS,
    PAGE,
    PREFIX,
    KernelLayout,
    LinearLayout,
    encode_prefix,
    linear_entry,
    module_entry,
    parse_header,
    parse_prefix,
    round_up,
    tensor_entry,
    torch_dtype,
)


class KernelFileWriter:
    """Streams modules into a new file: `add` each module's layout (`names`: all of them, in
    order, known up front), then `close` writes the header (the file is unreadable until then,
    so an interrupted convert leaves no valid file). The header goes in space reserved before
    the data (~1 KiB per module), so a file truncated later still names its lost tensors; a
    header that outgrows it goes after the data."""

    def __init__(self, path: Path, meta: dict[str, Any], names: list[str]) -> None:
        self.path, self.meta = path, dict(meta)
        self._f = open(path, "wb")  # noqa: SIM115 (closed in close())
        self._reserved = round_up(PAGE + sum(len(n) + 1024 for n in names), PAGE)
        self._f.write(bytes(self._reserved))  # the prefix and header, written at close
        self._pos = self._reserved
        self._modules: dict[str, dict[str, Any]] = {}
        self._linears: dict[str, dict[str, Any]] = {}

    def _pad_to(self, multiple: int) -> None:
        end = round_up(self._pos, multiple)
        self._f.write(bytes(end - self._pos))
        self._pos = end

    def add(self, name: str, layout: KernelLayout) -> None:
        self._modules[name] = module_entry(layout, self._write(FIELDS, layout.tensors))

    def add_linear(self, name: str, layout: LinearLayout, dtype: str) -> None:
        """A dense linear's Int8Linear layout (`dtype`: what its numbers were rounded from)."""
        entries = self._write(LINEAR_FIELDS, (layout.w, layout.scale))
        self._linears[name] = linear_entry(layout, entries, dtype)  # type: ignore[arg-type]

    def _write(self, fields, tensors) -> list[dict[str, Any] | None]:
        self._pad_to(PAGE)  # a module's pages are its own
        entries: list[dict[str, Any] | None] = []
        for field, t in zip(fields, tensors, strict=True):
            if t is None:
                entries.append(None)
                continue
            self._pad_to(ALIGN)
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            entries.append(tensor_entry(field, t, self._pos, xxhash.xxh3_64_intdigest(raw)))
            self._f.write(memoryview(raw))
            self._pos += t.nbytes
        return entries

    def close(self) -> int:
        """Writes the header and the prefix; returns the file's size."""
        import json

        linears = {"linears": self._linears} if self._linears else {}
        header = json.dumps({**self.meta, "modules": self._modules, **linears}).encode()
        end = self._pos
        if ALIGN + len(header) <= self._reserved:
            offset = ALIGN
        else:
            self._pad_to(ALIGN)
            offset = end = self._pos
            end += len(header)
        self._f.seek(offset)
        self._f.write(header)
        self._f.seek(0)
        self._f.write(encode_prefix(offset, len(header)))
        self._f.close()
        return end


class MappedKernelFile:
    """A kernel-layout file mapped read-only; `module(name)` returns views into the mapping."""

    def __init__(self, path: Path, verify: bool = True, remember: bool = False) -> None:
        self.path, self.verify, self.remember = path, verify, remember
        self._checked: set[str] = set()  # modules whose digests passed here
        self._checked_linears: set[str] = set()
        where = path.name
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            size = st.st_size
            self._stamp = self._stamp_path(st)
            if verify and remember and self._stamp.is_file():
                self.verify = False  # verified before, not written since: mapped, not read
            offset, length = parse_prefix(f.read(PREFIX.size), size, where)
            f.seek(offset)
            self.header = parse_header(f.read(length), size, where)
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        advise = getattr(mmap, "MADV_HUGEPAGE", None)
        if advise is not None:
            try:  # file THP needs the kernel's READ_ONLY_THP_FOR_FS; advisory elsewhere
                self._mm.madvise(advise)
            except OSError:
                pass
        with warnings.catch_warnings():
            # read-only on purpose: the kernels only read weights (a write would fault)
            warnings.simplefilter("ignore", UserWarning)
            self._buf = torch.frombuffer(self._mm, dtype=torch.uint8)

    def _stamp_path(self, st: os.stat_result) -> Path:
        key = "\0".join(str(v) for v in (os.path.realpath(self.path), st.st_dev, st.st_ino,
                                         st.st_size, st.st_mtime_ns, st.st_ctime_ns))  # fmt: skip
        return envs.cache_dir() / "verified" / hashlib.sha256(key.encode()).hexdigest()[:32]

    def mark_verified(self) -> bool:
        """Remembers the file as verified where `remember` and every module's digests passed
        here (the dense linears this load did not use are checked now: a later load that serves
        them must not find them unchecked); True when the stamp was written (an unwritable
        cache only costs the next load a check)."""
        if not (self.verify and self.remember) or self._checked != set(self.header["modules"]):
            return False
        for name in self.linear_names():
            if name not in self._checked_linears:
                self.linear(name)
        try:
            self._stamp.parent.mkdir(parents=True, exist_ok=True)
            self._stamp.write_text(f"{os.path.realpath(self.path)}\n")
        except OSError:
            return False
        return True

    def names(self) -> list[str]:
        return list(self.header["modules"])

    def nbytes(self) -> int:
        """Bytes of tensor data mapped (all modules)."""
        return sum(t["nbytes"] for m in self.header["modules"].values()
                   for t in m["tensors"] if t is not None)  # fmt: skip

    def module(self, name: str) -> KernelLayout:
        entry = self.header["modules"].get(name)
        if entry is None:
            raise MissingTensorError(
                f"{self.path.name} lacks the experts of {name!r}; re-run hetserve convert"
            )
        tensors = tuple(None if t is None else self._tensor(name, t) for t in entry["tensors"])
        if self.verify:
            self._checked.add(name)
        return KernelLayout(
            fmt=entry["fmt"], group_size=entry["group_size"], num_experts=entry["num_experts"],
            hidden=entry["hidden"], inter=entry["inter"], padded=tuple(entry["padded"]),
            tensors=tensors,
        )  # fmt: skip

    def linear_names(self) -> list[str]:
        return list(self.header.get("linears", {}))

    def linear(self, name: str) -> LinearLayout:
        """The dense linear `name`'s layout (views into the mapping); its entry's `dtype` is
        `linear_dtype(name)`."""
        entry = self.header["linears"][name]
        w, scale = (self._tensor(name, t) for t in entry["tensors"])
        if self.verify:
            self._checked_linears.add(name)
        return LinearLayout(
            fmt=entry["fmt"], group=entry["group"], in_features=entry["in"],
            out_features=entry["out"], rows=entry["rows"], w=w, scale=scale,
        )  # fmt: skip

    def linear_dtype(self, name: str) -> str:
        return self.header["linears"][name]["dtype"]

    def _tensor(self, module: str, t: dict[str, Any]) -> torch.Tensor:
        start, n = t["offset"], t["nbytes"]
        if self.verify:
            # xxh3-64 (12.7 GB/s on one core of the dev VM, CRC-32 2.8): files written before
            # it carry a CRC-32.
            kind, digest = ("xxh3", xxhash.xxh3_64_intdigest) if "xxh3" in t else (
                "crc32", zlib.crc32)  # fmt: skip
            with memoryview(self._mm) as whole, whole[start : start + n] as part:
                got = digest(part)
            if got != t[kind]:
                raise ModelLoadError(
                    f"{self.path.name}: tensor '{module}.{t['name']}' is corrupt ({kind} "
                    f"{got:x}, written {t[kind]:x}); re-run hetserve convert"
                )
        return self._buf[start : start + n].view(torch_dtype(t["dtype"])).view(t["shape"])
