"""Builds and loads hetserve's AVX2 kernels through ctypes: one shared library from

- `moe_kernels.c`: routed experts (fp32, weight-only int8 / int4) and plain int8 linears. The
  library ops cannot stream int4 weights (torch's `_weight_int4pack_mm_for_cpu`: ~0.2 GB/s
  here) and the only fast int8 one (fbgemm) also quantizes activations.
- `attention.c`: decode attention read straight from the paged KV cache (fp32). Gathering each
  sequence's context into a padded copy and running SDPA cost 3-4x more per decode step.
- `norm.c`: RMSNorm over fp32 rows, rotary embedding and softmax top-k routing, one call each
  instead of torch's five to eight small kernels (per-op overhead dominates them at decode).
- `pool.c`: the parallel loop they share (OpenMP).

It needs no torch headers: a C compiler builds it in a second or two the first time, into a
cache keyed by the sources and flags, and later processes just load it. ctypes releases the GIL
during a call, so a kernel overlaps Python work on other threads.
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
from typing import TYPE_CHECKING

from hetserve import envs

if TYPE_CHECKING:
    import torch

HERE = Path(__file__).parent
SOURCES = ("pool.c", "moe_kernels.c", "attention.c", "norm.c")
HEADERS = ("pool.h", "simd.h")
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fPIC", "-shared"]


def _cache_dir() -> Path:
    return envs.cache_dir() / "kernels"


def _cpu_supported() -> str | None:
    import torch

    if platform.machine() not in ("x86_64", "AMD64"):
        return f"needs an x86-64 CPU, this is {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"needs AVX2+FMA, torch reports CPU capability {capability}"
    return None


def _compile(compiler: str, flags: list[str], target: Path) -> str | None:
    """Builds the library at `target`; None on success, else the compiler's first line."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *flags, "-o", tmp, *(str(HERE / n) for n in SOURCES), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            return (proc.stderr.strip().splitlines() or ["?"])[0]
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def _build() -> tuple[ctypes.CDLL | None, str | None]:
    reason = _cpu_supported()
    if reason is not None:
        return None, reason
    compiler = envs.c_compiler() or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler (cc/gcc) on PATH"
    text = b"".join((HERE / name).read_bytes() for name in (*SOURCES, *HEADERS))
    error = "?"
    # With OpenMP the kernels share torch's thread team (pool.c); without, they run serially.
    for flags in ([*CFLAGS, "-fopenmp"], CFLAGS):
        key = hashlib.sha256(text + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
        target = _cache_dir() / f"hetserve_kernels-{key}.so"
        try:
            if target.exists() or (error := _compile(compiler, flags, target)) is None:
                lib = ctypes.CDLL(str(target))
                break
        except (OSError, subprocess.SubprocessError) as exc:  # read-only cache, bad compiler...
            error = f"cannot build or load the kernels in {target.parent}: {exc}"
    else:
        return None, f"compiling hetserve/native failed: {error}"
    fn = lib.hetserve_moe_forward
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int] * 8 + [ctypes.c_void_p] * 10
    fn = lib.hetserve_int8_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p] * 4
    fn = lib.hetserve_rms_norm
    fn.restype = None
    fn.argtypes = [ctypes.c_int] * 3 + [ctypes.c_float] + [ctypes.c_void_p] * 3
    fn = lib.hetserve_rope
    fn.restype = None
    fn.argtypes = [ctypes.c_int] * 5 + [ctypes.c_void_p] * 4
    fn = lib.hetserve_topk_softmax
    fn.restype = None
    fn.argtypes = [ctypes.c_int] * 5 + [ctypes.c_float] + [ctypes.c_void_p] * 3
    fn = lib.hetserve_paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int] * 10 + [ctypes.c_float] + [ctypes.c_void_p] * 6
    return lib, None


def native_unavailable_reason() -> str | None:
    """None when the native kernel can be used here, else why not (one line)."""
    return _build()[1]


def _lib() -> ctypes.CDLL:
    lib, reason = _build()
    if lib is None:
        raise RuntimeError(f"native kernels unavailable: {reason}")
    return lib


def moe_forward_fn():
    """The ctypes function `hetserve_moe_forward` (see moe_kernels.c for its arguments)."""
    return _lib().hetserve_moe_forward


def int8_linear_fn():
    """The ctypes function `hetserve_int8_linear` (see moe_kernels.c)."""
    return _lib().hetserve_int8_linear


def rms_norm_fn():
    """The ctypes function `hetserve_rms_norm` (see norm.c)."""
    return _lib().hetserve_rms_norm


def rope_fn():
    """The ctypes function `hetserve_rope` (see norm.c)."""
    return _lib().hetserve_rope


def topk_softmax_fn():
    """The ctypes function `hetserve_topk_softmax` (see norm.c)."""
    return _lib().hetserve_topk_softmax


def paged_decode_attention_fn():
    """The ctypes function `hetserve_paged_decode_attention` (see attention.c)."""
    return _lib().hetserve_paged_decode_attention


_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


@cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def hugepage_empty(shape: tuple[int, ...], dtype) -> torch.Tensor:
    """An uninitialised tensor whose memory asks for 2 MiB transparent huge pages.

    Streaming a weight matrix crosses a 4 KiB page every 64 cache lines; the hardware prefetcher
    stops at each, and each costs a TLB walk. With THP in `madvise` mode (common default) the
    pages must be requested before they are first touched, hence a fresh, 2 MiB-aligned view.
    Where madvise is unavailable this is just a plain tensor.
    """
    import torch

    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    libc = _libc()
    if libc is None or nbytes < _HUGE or platform.system() != "Linux":
        return torch.empty(shape, dtype=dtype)
    base = torch.empty(nbytes + _HUGE, dtype=torch.uint8)
    start = (base.data_ptr() + _HUGE - 1) // _HUGE * _HUGE
    libc.madvise(start, nbytes // _HUGE * _HUGE, _MADV_HUGEPAGE)  # advisory: failure is fine
    offset = start - base.data_ptr()
    return base[offset : offset + nbytes].view(dtype).view(shape)
