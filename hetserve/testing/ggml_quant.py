"""llama.cpp's own quantizer for one matrix (ggml_quantize_chunk in the libggml-base that
llama-cpp-python ships), so tests and benches get real blocks of every GGUF type, i-quants
included: IQ2_* and IQ1_* need an importance matrix, given here as all ones (every column
equally important; llama.cpp's tools use one measured on text).

Who calls it: tests and `bench moe-kernel`. Failure: `ggml_unavailable_reason()` says why it
cannot run (llama-cpp-python not installed, or its library lacks the symbol); `ggml_quantize`
raises RuntimeError then.
"""

from __future__ import annotations

import ctypes
import importlib.util
from functools import cache
from pathlib import Path

import numpy as np


@cache
def _quantize_chunk() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | str:  # type: ignore[name-defined]
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return "llama-cpp-python is not installed"
    lib = Path(spec.origin).parent / "lib" / "libggml-base.so"
    try:
        base = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
        fn, init = base.ggml_quantize_chunk, base.ggml_quantize_init
    except (OSError, AttributeError) as exc:
        return f"llama.cpp's ggml library cannot be used: {exc}"
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]  # fmt: skip
    init.argtypes = [ctypes.c_int]
    return fn, init


def ggml_unavailable_reason() -> str | None:
    found = _quantize_chunk()
    return found if isinstance(found, str) else None


def ggml_quantize(w: np.ndarray, kind: str) -> np.ndarray:
    """[.., N, K] fp32 -> the bytes of GGML type `kind` (the gguf package's name, e.g. IQ4_XS)
    [.., N, K / block * bytes per block], as llama.cpp's quantizer writes them."""
    import gguf

    found = _quantize_chunk()
    if isinstance(found, str):
        raise RuntimeError(found)
    fn, init = found
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    k = w.shape[-1]
    src = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, k)
    out = np.zeros((src.shape[0], k // block * size), np.uint8)
    importance = np.ones(k, np.float32)
    init(int(qtype))
    n = fn(int(qtype), src.ctypes.data, out.ctypes.data, 0, src.shape[0], k,
           importance.ctypes.data)  # fmt: skip
    if n != out.size:
        raise RuntimeError(f"ggml_quantize_chunk wrote {n} bytes of {kind}, expected {out.size}")
    return out.reshape(*w.shape[:-1], -1)
