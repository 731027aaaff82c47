"""The host heap while a model loads (glibc's malloc): who calls it is model/build.py, around
the loader (`copies_unmapped` while a GGUF file is read, `heap_reused` around each layer's
backends, `trim_heap` once the weights are in), so a load's freed copies leave the process
instead of staying in its heap. Without glibc every function is a no-op; nothing here raises.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator


def trim_heap() -> None:
    """Hand the loader's freed buffers back to the OS: glibc keeps freed heap pages of
    allocations under its (grown) mmap threshold, which left ~230 MB of a 200 MB model's
    transient copies resident after load. Called once the weights are read too, before the
    dense linears' layouts are built: the last layer's freed copies stayed resident and those
    layouts came on top of them (1.7 B q8_0 GGUF: peak 2226 -> 2098 MiB over the start). Not
    after every layer of a GGUF: each layer's reads reuse the heap the one before freed, and
    handing it back made every layer fault its pages in anew (load 11-12 s -> 13.7 s on the
    dev VM). After every layer of a dense checkpoint rounded as read: its fp32 reads and the
    rounding's temporaries, freed between the int8 matrices kept, leave holes no later read
    fits, and the free heap grew by ~1 GB over the 1.7 B MoE's 8 layers (peak 2910 -> ~2280
    MiB)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):  # glibc only
        libc.malloc_trim(0)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_LOAD_MMAP_THRESHOLD = 256 << 10
# glibc's dynamic threshold grows, as large blocks are freed, up to 32 MiB (64-bit), the trim
# threshold to twice that: where a serving process settles after its first long prompts
_SERVE_MMAP_THRESHOLD = 32 << 20


@contextlib.contextmanager
def copies_unmapped() -> Iterator[bool]:
    """While a GGUF file is read, glibc maps every allocation of 256 KiB or more on its own, so
    an expert's copy out of the file goes back to the OS the moment it is freed: the backends
    lay each expert out and let its copy go (moe/native_layout.py), which lowers the peak only
    if the freed pages leave the process (under glibc's grown threshold they stayed in its
    heap until the next layer's copies reused them: the 1.7 B MoE's Q4_K_M GGUF peaked at
    1.19-1.21x the file over the process at start, ~1.09x with this). The layouts' own
    temporaries reuse the heap (`heap_reused`, around each layer's backends). Afterwards the
    thresholds are those glibc's would have grown to (32 MiB, trim 64 MiB): setting one ends
    its adjustment. Not for safetensors (their fp32 reads would fault every page anew; their
    heap is trimmed instead: `trim_heap`). Without glibc a no-op (yields False)."""
    if _mallopt(_M_MMAP_THRESHOLD, _LOAD_MMAP_THRESHOLD):
        try:
            yield True
        finally:
            _settle_heap()
    else:
        yield False


def _settle_heap() -> None:
    _mallopt(_M_MMAP_THRESHOLD, _SERVE_MMAP_THRESHOLD)
    _mallopt(_M_TRIM_THRESHOLD, 2 * _SERVE_MMAP_THRESHOLD)


@contextlib.contextmanager
def heap_reused() -> Iterator[None]:
    """Inside `copies_unmapped`: a layer's layouts, whose per-expert temporaries are cheaper
    reused from the heap than mapped and faulted in one by one (IQ4_XS: load ~3 s -> ~7 s)."""
    _settle_heap()
    try:
        yield
    finally:
        _mallopt(_M_MMAP_THRESHOLD, _LOAD_MMAP_THRESHOLD)


def _mallopt(param: int, value: int) -> bool:
    libc = _libc()
    return libc is not None and hasattr(libc, "mallopt") and libc.mallopt(param, value) == 1


@functools.cache
def _libc():
    """The C library, looked up once: find_library runs `ldconfig -p`, a fork of the loading
    process each time."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None
