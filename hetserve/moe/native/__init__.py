"""Builds and loads the AVX2 weight-only MoE kernel (`moe_kernels.c`) through ctypes.

The library ops cannot stream int4 weights (torch's `_weight_int4pack_mm_for_cpu`: ~0.2 GB/s
here) and the only fast int8 one (fbgemm) also quantizes activations, so hetserve carries one
small C file. It needs no torch headers: a C compiler builds it in about a second the first time,
into a cache keyed by the source and flags, and later processes just load it. ctypes releases
the GIL during the call, so the kernel overlaps Python work on other threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

SOURCE = Path(__file__).with_name("moe_kernels.c")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-pthread"]


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "hetserve" / "kernels"


def _cpu_supported() -> str | None:
    import torch

    if platform.machine() not in ("x86_64", "AMD64"):
        return f"needs an x86-64 CPU, this is {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"needs AVX2+FMA, torch reports CPU capability {capability}"
    return None


@cache
def _build() -> tuple[ctypes.CDLL | None, str | None]:
    reason = _cpu_supported()
    if reason is not None:
        return None, reason
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler (cc/gcc) on PATH"
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *CFLAGS]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"moe_kernels-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent processes never load a partial file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [compiler, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            first = (proc.stderr.strip().splitlines() or ["?"])[0]
            return None, f"compiling {SOURCE.name} failed: {first}"
        os.replace(tmp, target)
    lib = ctypes.CDLL(str(target))
    fn = lib.hetserve_moe_forward
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int] * 8 + [ctypes.c_void_p] * 10
    return lib, None


def native_unavailable_reason() -> str | None:
    """None when the native kernel can be used here, else why not (one line)."""
    return _build()[1]


def moe_forward_fn():
    """The ctypes function `hetserve_moe_forward` (see moe_kernels.c for its arguments)."""
    lib, reason = _build()
    if lib is None:
        raise RuntimeError(f"native MoE kernel unavailable: {reason}")
    return lib.hetserve_moe_forward
