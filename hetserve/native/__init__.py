"""Builds and loads hetserve's AVX2 kernels through ctypes: one shared library from

- `moe_kernels.c` (+ `moe_quads.h`, `moe_formats.h`, `moe_q4k.h`): routed experts (fp32,
  weight-only int8 / int4, and the published grouped int8, MXFP4, FP8 and GGUF q4_K formats);
  `linear_kernels.c`: plain quantized linears (int8, q8_0, q4_K) on the same microkernels. The
  library ops cannot stream int4 weights (torch's `_weight_int4pack_mm_for_cpu`: ~0.2 GB/s
  here) and the only fast int8 one (fbgemm) also quantizes activations.
- `attention.c`: decode attention read straight from the paged KV cache (fp32). Gathering each
  sequence's context into a padded copy and running SDPA cost 3-4x more per decode step.
- `prefill_attention.c`: causal attention of a prompt chunk over the paged cache, flash-style
  (query and key tiles, online softmax; no score matrix beyond a tile), instead of gathering
  the context and running SDPA with a materialized mask.
- `small_ops.c`: RMSNorm over fp32 rows, rotary embedding and softmax top-k routing, one call
  each instead of torch's five to eight small kernels (per-op overhead dominates at decode);
  and the KV tiers' block copies (one memcpy per block and part).
- `linear_attn.c`: a linear-attention layer's decode step (short convolution, q/k norms, the
  gated delta rule) in place on the state slots: one read and one cached rewrite of each
  state instead of torch's six passes and two copies.
- `pool.c`: the parallel loop they share (OpenMP).
- `numa.c`: `--numa auto`'s binding (moe/numa_experts.py): a shard's weights bound to its
  node (mbind), the node of a page, a thread team pinned to the node's CPUs.
- `peaks.c`: the CPU's fp32 / int16 / int8 / bf16 multiply-add peaks, measured (`bench
  prefill` reads its rows against them).
- `gguf_rows.c`: rows of a GGUF q4_K / q5_K / q6_K / q3_K / q2_K / IQ4_XS / IQ4_NL matrix
  dequantized to fp32, gguf's own numbers (token embeddings kept in the file's blocks).
- `mla_decode.c`: DeepSeek-V3.2's indexer scores at decode, every key read in place from the
  paged cache (fp32, fp16 or int8); MLA's absorbed per-head products over fp16 matrices.
- `layouts.c`: a GGUF q4_K matrix's blocks rearranged into the expert kernel's quad layout at
  load (moe/native_layout.py), the same bytes as quant/layout.py's torch version.

It needs no torch headers: a C compiler builds it in a second or two the first time, into a
cache keyed by the sources and flags, and later processes just load it. The flags name the
instruction set (`isa()`): AVX2 + FMA everywhere, plus AVX-512 BW/VL/VNNI where the CPU has them
(the q4_K, int4, MXFP4 and FP8 microkernels then take 512-bit paths, the integer ones with the
same results; HETSERVE_NATIVE_ISA=avx2 turns that off), plus AMX tiles for the int8 expert
GEMMs of prefill where the CPU has AMX-INT8 and Linux grants it (`amx`, same sums;
HETSERVE_NATIVE_ISA=avx512bf16 turns it off). ctypes releases the GIL during a call,
so a kernel overlaps Python work on other threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from hetserve import envs

if TYPE_CHECKING:
    import torch

HERE = Path(__file__).parent
SOURCES = ("pool.c", "moe_kernels.c", "moe_prefill.c", "linear_kernels.c", "attention.c",
           "small_ops.c", "moe_backward.c", "decode_layers.c", "hashing.c", "linear_attn.c",
           "peaks.c", "prefill_attention.c", "numa.c", "gguf_rows.c", "layouts.c",
           "mla_decode.c")  # fmt: skip
HEADERS = ("pool.h", "simd.h", "moe_quads.h", "moe_formats.h", "moe_q4k.h", "moe_kq.h",
           "moe_gemm.h", "moe_job.h", "moe_kgemm.h", "moe_amx.h", "moe_iqg.h")  # fmt: skip
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-shared"]
# What each instruction set adds to CFLAGS, and the /proc/cpuinfo flags it needs.
# Narrowest first; avx512bf16 adds the FP8 experts kernel's bf16 path (simd.h, HS_FP8_BF16) and,
# with VBMI and BITALG (which every CPU with AVX512-BF16 but Cooper Lake has), the grid
# i-quants' in-register point lookups (moe_iqg.h, HS_IQG_PLANES).
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]
# amx adds the int8 expert GEMMs on AMX tiles (moe_amx.h; the same sums as the AVX-512 path).
_BF16 = [*_AVX512, "-mavx512bf16", "-mgfni", "-mavx512vbmi", "-mavx512bitalg"]
ISA_FLAGS = {
    "avx2": [],
    "avx512": _AVX512,
    "avx512bf16": _BF16,
    "amx": [*_BF16, "-mamx-tile", "-mamx-int8", "-DHS_AMX"],
}
_AVX512_CPU = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")
_BF16_CPU = (*_AVX512_CPU, "avx512_bf16", "gfni", "avx512vbmi", "avx512_bitalg")
_ISA_CPU = {"avx512": _AVX512_CPU, "avx512bf16": _BF16_CPU,
            "amx": (*_BF16_CPU, "amx_tile", "amx_int8")}  # fmt: skip
# Builds for tests alone (never chosen by isa()): the AMX loops on a C model of the tiles, so a
# CPU without AMX checks their layouts against the AVX path.
TEST_FLAGS = {"amx-emulated": ["-DHS_AMX", "-DHS_AMX_EMULATE"]}


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


@cache
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def cpu_has(isa: str) -> bool:
    """Whether this CPU runs the kernels built for `isa` (a key of ISA_FLAGS)."""
    return _cpu_flags().issuperset(_ISA_CPU.get(isa, ()))


@cache
def isa() -> str:
    """The instruction set the kernels are built for here: HETSERVE_NATIVE_ISA, or (auto) the
    widest one this CPU has. Asking for one the CPU lacks raises."""
    from hetserve.errors import InvalidInputError

    wanted = envs.native_isa()
    if wanted == "auto":
        return [name for name in ISA_FLAGS if cpu_has(name)][-1]
    if wanted not in ISA_FLAGS:
        raise InvalidInputError(
            f"HETSERVE_NATIVE_ISA={wanted!r} is not one of auto, {', '.join(ISA_FLAGS)}"
        )
    if not cpu_has(wanted):
        raise InvalidInputError(
            f"HETSERVE_NATIVE_ISA={wanted} but this CPU lacks {', '.join(_ISA_CPU[wanted])}; "
            "use auto"
        )
    return wanted


def _compile(compiler: str, flags: list[str], target: Path) -> str | None:
    """Builds the library at `target`; None on success, else the compiler's first line."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *flags, "-o", tmp, *(str(HERE / n) for n in SOURCES), "-lm", "-ldl"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            return (proc.stderr.strip().splitlines() or ["?"])[0]
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_I, _L, _F, _P = ctypes.c_int, ctypes.c_long, ctypes.c_float, ctypes.c_void_p
_I64 = ctypes.c_int64
# Each exported function: (restype, argtypes), as declared in the C sources.
_SIGNATURES = {
    # native/hash_chain.py, disagg/key_table.py
    "hetserve_hash_blocks": (_I, [_P, _I64, _P, _I64, _I64, _P, _I64, _P]),
    "hetserve_key_lookup": (None, [_P, _P, ctypes.c_uint64, _P, _I64, _P]),
    "hetserve_digest_lookup": (None, [_P, _P, ctypes.c_uint64, _P, _P, _I64, _P]),
    "hetserve_moe_new": (_P, [_I] * 5 + [_P] * 6 + [_I, _F, _F]),  # moe/cpu_native.py
    "hetserve_moe_free": (None, [_P]),
    "hetserve_moe_run": (_I, [_P, _I, _I, _I] + [_P] * 4),
    "hetserve_moe_shard": (None, [_P, _I, _I]),  # moe/numa_experts.py
    "hetserve_moe_run_shard": (_I, [_P, _I, _I, _I] + [_P] * 5 + [_I]),
    "hetserve_mbind": (_I, [_P, _L, _I]),
    "hetserve_page_node": (_I, [_P]),
    "hetserve_team_pin": (_I, [_I, _P, _I, _P]),
    "hetserve_team_new": (_P, [_P, _I, _I, _P, _P, _P]),
    "hetserve_team_free": (None, [_P]),
    "hetserve_moe_run_teams": (_I, [_P, _P] + [_I] * 3 + [_P] * 4),
    "hetserve_moe_last_seconds": (ctypes.c_double, [_P]),  # bench moe-kernel's kernel time
    "hetserve_moe_touch": (_I, [_P, _I, _I, _I, _P, _P, _P]),  # bench moe-kernel's read limit
    "hetserve_moe_padded": (_I, [_I] * 3),  # quant/layout.py's padded_size
    "hetserve_int8_linear": (_I, [_I] * 4 + [_P] * 4),
    "hetserve_qlinear": (_I, [_I] * 6 + [_P] * 4),
    "hetserve_paged_decode_attention": (_I, [_I] * 10 + [_F] + [_P] * 7),
    "hetserve_paged_decode_attention_f16": (_I, [_I] * 10 + [_F] + [_P] * 7),
    "hetserve_paged_decode_attention_i8": (_I, [_I] * 10 + [_F] + [_P] * 9),
    "hetserve_prefill_attention": (_I, [_I] * 8 + [_L, _F] + [_P] * 6 + [_I]),
    "hetserve_prefill_attention_f16": (_I, [_I] * 8 + [_L, _F] + [_P] * 6 + [_I]),
    "hetserve_prefill_attention_i8": (_I, [_I] * 8 + [_L, _F] + [_P] * 8 + [_I]),
    "hetserve_prefill_bf16_ok": (_I, [_I, _I]),
    "hetserve_rms_norm": (None, [_I] * 3 + [_F] + [_P] * 3),
    "hetserve_rope": (None, [_I] * 5 + [_P] * 4),
    "hetserve_topk_softmax": (None, [_I] * 5 + [_F] + [_P] * 3),
    "hetserve_router_logits": (None, [_I] * 4 + [_P] * 3),
    "hetserve_qk_rope_cache": (_I, [_I] * 6 + [_L] * 3 + [_I, _L, _F] + [_P] * 12),
    "hetserve_qk_rope_cache_f16": (_I, [_I] * 6 + [_L] * 3 + [_I, _L, _F] + [_P] * 12),
    "hetserve_qk_rope_cache_i8": (_I, [_I] * 6 + [_L] * 3 + [_I, _L, _F] + [_P] * 14),
    "hetserve_moe_backward": (_I, [_I] * 8 + [_P] * 12),  # finetune/experts_grad.py
    "hetserve_copy_parts": (None, [_I] * 3 + [_P] * 7),  # engine/kv_store.py
    "hetserve_decode_layers": (_I, [_I, _I, _P, _I] + [_P] * 4 + [_I, _P]),  # fused_decode.py
    "hetserve_delta_decode": (_I, [_I] * 9 + [_P] * 8),  # layers/linear_attention.py
    "hetserve_peak": (ctypes.c_double, [_I, _I, _L]),  # bench/peaks.py
    "hetserve_peak_ops": (_L, [_I]),
    "hetserve_gguf_rows": (_I, [_I, _P, _I64, _I64, _P, _I, _I, _P]),  # layers/quant_embedding.py
    "hetserve_q4k_quads": (_I, [_I] * 3 + [_P, _I, _P]),  # moe/native_layout.py
    "hetserve_mxfp4_split": (_I, [_I, _L, _P, _P, _P]),  # quant/gguf.py (GGUF MXFP4 experts)
    "hetserve_unit_tiles": (_I, [_I, _I, _L, _I, _I, _I, _P, _P]),  # moe/native_layout.py
    "hetserve_kq_lanes": (_I, [_I, _I, _L, _P, _P]),  # quant/lane_order.py
    "hetserve_amx_ready": (_I, []),  # tests, bench moe-kernel
    "hetserve_index_scores": (_I, [_I] * 9 + [_P] * 7),  # model/deepseek_v32.py
    "hetserve_heads_gemv_f16": (None, [_I] * 5 + [_P] * 3),  # model/deepseek.py
    "hetserve_iq_grids": (None, [_P] * 6),  # build_for: the grid i-quants' tables (moe_iqg.h)
}


_GRID_NAMES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S")


@cache
def _iq_grids() -> tuple:
    """gguf's tables of the grid i-quants (its `grid`, the points' values), in the bytes
    moe_iqg.h reads: IQ2's points as uint8 x 8, IQ3's as uint8 x 4, IQ1's as int8 x 8 times 8.
    Kept for the life of the process (the library holds pointers into them). Made once per
    gguf version and kept beside the built library: importing gguf to make them took ~55 ms of
    every start-up (a converted checkpoint's whole load is ~80 ms)."""
    import importlib.metadata

    import numpy as np

    try:
        version = importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    path = _cache_dir() / f"iq-grids-{version}.npz"
    try:
        with np.load(path) as saved:
            return tuple(np.ascontiguousarray(saved[name]) for name in _GRID_NAMES)
    except (OSError, KeyError, ValueError):
        pass
    from gguf import quants

    def table(name, dtype, scale=1):
        cls = getattr(quants, name)
        cls.init_grid()
        return np.ascontiguousarray((cls.grid.reshape(cls.grid_shape) * scale).astype(dtype))

    tables = tuple(table(n, np.int8, 8) if n == "IQ1_S" else table(n, np.uint8)
                   for n in _GRID_NAMES)  # fmt: skip
    try:  # written whole, then renamed: a concurrent reader sees no half file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(tmp, **dict(zip(_GRID_NAMES, tables, strict=True)))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: made again next time
    return tables


@cache
def _build() -> tuple[ctypes.CDLL | None, str | None]:
    reason = _cpu_supported()
    if reason is not None:
        return None, reason
    return build_for(isa())


@cache
def build_for(isa_name: str) -> tuple[ctypes.CDLL | None, str | None]:
    """The library built for `isa_name` (a key of ISA_FLAGS), or None and why not. `kernel`
    uses the one for `isa()`; tests load another to compare the two."""
    compiler = envs.c_compiler() or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler (cc/gcc) on PATH"
    text = b"".join((HERE / name).read_bytes() for name in (*SOURCES, *HEADERS))
    error = "?"
    extra = ISA_FLAGS[isa_name] if isa_name in ISA_FLAGS else TEST_FLAGS[isa_name]
    base = [*CFLAGS, *extra]
    # With OpenMP the kernels share torch's thread team (pool.c); without, they run serially.
    said = not sys.stderr.isatty()  # a first run is otherwise silent for half a minute
    for flags in ([*base, "-fopenmp"], base):
        key = hashlib.sha256(text + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
        target = _cache_dir() / f"hetserve_kernels-{key}.so"
        if not target.exists() and not said:
            said = True
            print(f"building hetserve's CPU kernels for this machine ({isa_name}); once, "
                  "about half a minute", file=sys.stderr, flush=True)  # fmt: skip
        try:
            if target.exists() or (error := _compile(compiler, flags, target)) is None:
                lib = ctypes.CDLL(str(target))
                break
        except (OSError, subprocess.SubprocessError) as exc:  # read-only cache, bad compiler...
            error = f"cannot build or load the kernels in {target.parent}: {exc}"
    else:
        return None, f"compiling hetserve/native failed: {error}"
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    lib.hetserve_iq_grids(*(t.ctypes.data for t in _iq_grids()))
    return lib, None


def fp8_activations() -> str:
    """How the FP8 experts kernel built here rounds its activations: "bf16x2" (the avx512bf16
    build: each input as a sum of two bf16, within 2^-18 of it, and weights below e4m3's
    smallest normal 2^-6 read as zero) or "fp32" (weights converted to fp32 exactly, fp32
    products)."""
    return "bf16x2" if isa() == "avx512bf16" else "fp32"


def native_unavailable_reason() -> str | None:
    """None when the native kernel can be used here, else why not (one line)."""
    return _build()[1]


def kernel(name: str):
    """The ctypes function `name` (one of _SIGNATURES; see the C sources for its arguments).
    Raises where the kernels are unavailable."""
    lib, reason = _build()
    if lib is None:
        raise RuntimeError(f"native kernels unavailable: {reason}")
    return getattr(lib, name)


@cache
def optional_kernel(name: str):
    """The ctypes function `name`, or None where the kernels cannot be built here; for callers
    that fall back to torch. (HETSERVE_NATIVE_KERNELS is theirs to check, per call.)"""
    return kernel(name) if native_unavailable_reason() is None else None


_HUGE = 2 << 20


def hugepage_empty(shape: tuple[int, ...], dtype) -> torch.Tensor:
    """An uninitialised tensor whose memory asks for 2 MiB transparent huge pages.

    Streaming a weight matrix crosses a 4 KiB page every 64 cache lines; the hardware prefetcher
    stops at each, and each costs a TLB walk. With THP in `madvise` mode (common default) the
    pages must be requested before they are first touched. Memory from the allocator may be
    reused and already backed by 4 KiB pages (after a loader frees its buffers, most of it
    is), so this maps fresh anonymous memory (mmap) and advises its 2 MiB-aligned part first.
    Where madvise is unavailable this is just a plain tensor.
    """
    import mmap

    import torch

    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is None or nbytes < _HUGE or platform.system() != "Linux":
        return torch.empty(shape, dtype=dtype)
    # fresh private pages, none touched yet (a shared mapping would be shmem, outside anon THP)
    region = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping
    offset = -base.data_ptr() % _HUGE
    try:
        region.madvise(advise, offset, nbytes // _HUGE * _HUGE)
    except OSError:
        pass  # advisory: without it the pages are plain 4 KiB ones
    return base[offset : offset + nbytes].view(dtype).view(shape)
