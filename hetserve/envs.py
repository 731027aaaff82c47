"""Every environment variable hetserve reads, in one place (read when asked, never cached)."""

from __future__ import annotations

import os
from pathlib import Path

STORE_TOKEN = "HETSERVE_STORE_TOKEN"
LLAMA_CPP_SRC = "HETSERVE_LLAMA_CPP_SRC"


def cache_dir() -> Path:
    """HETSERVE_CACHE: demo model, tokenizer and compiled kernels (default ~/.cache/hetserve)."""
    return Path(os.environ.get("HETSERVE_CACHE") or Path.home() / ".cache" / "hetserve")


def api_key() -> str | None:
    """HETSERVE_API_KEY: bearer token required by (and sent to) the OpenAI server."""
    return os.environ.get("HETSERVE_API_KEY") or None


def admin_key() -> str | None:
    """HETSERVE_ADMIN_KEY: the Conductor's key for changing its instances."""
    return os.environ.get("HETSERVE_ADMIN_KEY") or None


def openai_api_key() -> str | None:
    """OPENAI_API_KEY: what `hetserve bench serve` sends to a third-party server."""
    return os.environ.get("OPENAI_API_KEY") or None


def store_token() -> str:
    """HETSERVE_STORE_TOKEN: shared token of the pool store services."""
    return os.environ.get(STORE_TOKEN, "")


def handoff_token() -> str:
    """HETSERVE_HANDOFF_TOKEN: the shared token of prefill -> decode KV hand-offs (needed when
    an instance receives them beyond loopback)."""
    return os.environ.get("HETSERVE_HANDOFF_TOKEN", "")


def step_trace() -> Path | None:
    """HETSERVE_STEP_TRACE: a file the engine appends one JSON line per step to (its shape,
    predicted and measured time, the gap before it, garbage collections during it); unset: none."""
    v = os.environ.get("HETSERVE_STEP_TRACE")
    return Path(v) if v else None


def c_compiler() -> str | None:
    """CC: the compiler for the native expert kernels."""
    return os.environ.get("CC") or None


def native_isa() -> str:
    """HETSERVE_NATIVE_ISA: which instruction set the native kernels are built for: `auto`
    (default: the widest this CPU has), `avx2`, `avx512` (AVX-512 BW/VL/DQ and VNNI),
    `avx512bf16` (those, BF16, GFNI, VBMI and BITALG: the FP8 experts kernel on bf16
    activations, the grid i-quants' points looked up in registers) or `amx`
    (those and AMX-INT8: the int8 GEMMs of prefill on tiles, the same results)."""
    return os.environ.get("HETSERVE_NATIVE_ISA", "auto").strip().lower() or "auto"


def llama_cpp_src() -> str | None:
    """HETSERVE_LLAMA_CPP_SRC: an unpacked llama.cpp source tree (its GGUF converter)."""
    return os.environ.get(LLAMA_CPP_SRC) or None


def native_kernels() -> bool:
    """HETSERVE_NATIVE_KERNELS=0 turns off the C kernels hetserve picks on its own on the CPU
    (decode attention over the paged cache, fp32 routed experts without placement, int8
    non-expert linears, which then use fbgemm, RMSNorm, rotary embedding, the router's logits
    at decode and softmax top-k routing, the fused q/k norm + rotary + KV write of GQA layers,
    the fused decode step of model/fused_decode.py); the torch paths they
    replace are the reference. Expert backends named in placement rules (`cpu-int8` with
    kernel "auto", ...) are not affected."""
    # Asked by every layer on every forward: os.environ.get encodes the key each time (~1.5 us,
    # ~70 calls per decode step); on POSIX the bytes mapping behind it answers directly.
    if _ENV_BYTES is not None:
        return bool(_ENV_BYTES.get(b"HETSERVE_NATIVE_KERNELS", b"1") != b"0")
    return os.environ.get("HETSERVE_NATIVE_KERNELS", "1") != "0"


# os.environ's own storage (kept in sync by os.environ[...] = ..., monkeypatch.setenv, ...).
_ENV_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None


def verify_converted() -> str:
    """HETSERVE_VERIFY_CONVERTED: when a mapped kernel-layout checkpoint's tensor digests are
    checked at load. `1` (default): "once", the first load of each version of the file (the
    check reads the whole file; a passed check is remembered under HETSERVE_CACHE by the file's
    device, inode, size, mtime and ctime, so any write to it asks again); `always`: every load;
    `0`: "never"."""
    value = os.environ.get("HETSERVE_VERIFY_CONVERTED", "1").strip().lower()
    return {"0": "never", "always": "always"}.get(value, "once")


def step_probe_cache() -> bool:
    """HETSERVE_STEP_PROBE_CACHE: `0` times the start-up step probes at every start instead of
    reusing the last ones measured for the same model, placement, code and machine."""
    return os.environ.get("HETSERVE_STEP_PROBE_CACHE", "1").strip() != "0"


def numa_sysfs() -> Path | None:
    """HETSERVE_NUMA_SYSFS: a directory read as /sys/devices/system/node by `--numa auto`
    (tests and the fake two-node benchmark); unset: the real one."""
    value = os.environ.get("HETSERVE_NUMA_SYSFS")
    return Path(value) if value else None
