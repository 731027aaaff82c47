"""The llama.cpp peer of `bench decode`: a GGUF converted from the same HF weights (q8_0 by the
converter, or by llama.cpp's own quantizer from a bf16 conversion: q4_K, every tensor q4_K
("pure"), or the mixes people download, Q4_K_M, IQ4_XS...), timed through llama-cpp-python.
Optional: without the package the peer is skipped with the reason. hetserve can load the same
file (`--model file.gguf`), so the bench also times it.

The conversion runs llama.cpp's own `convert_hf_to_gguf.py` (in the llama-cpp-python sdist under
vendor/llama.cpp) in a subprocess, once; the GGUF is cached next to the model. Its one change: a
BPE pre-tokenizer the converter does not know by hash (every tokenizer trained offline, like the
tiny models') is written as "gpt-2", the byte-level regex split our tokenizers use. The bench
feeds token ids, so the pre-tokenizer never runs; it only has to be a name llama.cpp accepts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from safetensors import safe_open


def gguf_name(kind: str) -> str:
    return f"model-{kind}.gguf"


# Runs in a fresh interpreter: argv[1] is the llama.cpp source tree, the rest the converter's own
# arguments. Patching the class keeps every architecture's vocab code as upstream wrote it.
_CONVERT = """
import sys
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import base

_upstream = base.TextModel.get_vocab_base_pre

def _pre(self, tokenizer):
    try:
        return _upstream(self, tokenizer)
    except NotImplementedError:  # unknown hash: an offline-trained byte-level BPE
        return "gpt-2"

base.TextModel.get_vocab_base_pre = _pre

# transformers 5 loads byte-level tokenizers as TokenizersBackend, which drops
# tokenizer_config.json's add_bos_token; the DeepSeek-V3.2 converter asserts it: put it back.
import json, os, transformers
_auto = transformers.AutoTokenizer.from_pretrained

def _tokenizer(path, *args, **kwargs):
    tok = _auto(path, *args, **kwargs)
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            bos = json.load(f).get("add_bos_token")
    except (OSError, ValueError, TypeError):
        return tok
    if bos and not getattr(tok, "add_bos_token", False):
        try:
            tok.add_bos_token = True
        except Exception:
            pass
    return tok

transformers.AutoTokenizer.from_pretrained = _tokenizer
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def find_converter(src: str | None) -> Path | None:
    """The llama.cpp tree holding convert_hf_to_gguf.py: SRC itself or SRC/vendor/llama.cpp (an
    unpacked llama-cpp-python sdist)."""
    if not src:
        return None
    for root in (Path(src), Path(src) / "vendor" / "llama.cpp"):
        if (root / "convert_hf_to_gguf.py").is_file() and (root / "gguf-py").is_dir():
            return root
    return None


def convert(model: str | Path, out: str | Path, src: Path, outtype: str = "q8_0") -> Path:
    """Write a GGUF of MODEL (q8_0, bf16, f32) to OUT with llama.cpp's converter; raises on
    failure."""
    out = Path(out)
    tmp = out.with_suffix(".partial")
    cmd = [sys.executable, "-c", _CONVERT, str(src), str(model), "--outtype", outtype,
           "--outfile", str(tmp), *_mtp_flag(Path(model))]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed (rc {proc.returncode}):\n{tail}")
    tmp.replace(out)  # a killed conversion never leaves a GGUF that looks complete
    return out


def _mtp_flag(model: Path) -> list[str]:
    """The converter expects Qwen3-Next / Qwen3.5 checkpoints to hold their MTP layers (the
    published ones do); one without them converts only with --no-mtp."""
    try:
        cfg = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return []
    if not any(a.startswith(("Qwen3Next", "Qwen3_5")) for a in cfg.get("architectures", [])):
        return []
    names: set[str] = set()
    for f in model.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            names.update(st.keys())
    return [] if any(".mtp." in n or n.startswith("mtp.") for n in names) else ["--no-mtp"]


# --gguf-type -> (llama.cpp file type, pure). "q4_K" is every tensor q4_K (`llama-quantize
# --pure`); the upper-case names are the mixes people download, with llama.cpp's own choice of
# type per tensor (Q4_K_M: q6_K for some ffn_down and the output, q4_K elsewhere).
QUANT_TYPES = {
    "q4_K": ("LLAMA_FTYPE_MOSTLY_Q4_K_M", True),
    "Q4_K_M": ("LLAMA_FTYPE_MOSTLY_Q4_K_M", False),
    "Q5_K_M": ("LLAMA_FTYPE_MOSTLY_Q5_K_M", False),
    "Q6_K": ("LLAMA_FTYPE_MOSTLY_Q6_K", False),
    "IQ4_XS": ("LLAMA_FTYPE_MOSTLY_IQ4_XS", False),
    "IQ4_NL": ("LLAMA_FTYPE_MOSTLY_IQ4_NL", False),
    "Q3_K_M": ("LLAMA_FTYPE_MOSTLY_Q3_K_M", False),
    "Q2_K": ("LLAMA_FTYPE_MOSTLY_Q2_K", False),
}


# every --gguf-type: q8_0 straight from the converter, the rest through the quantizer
GGUF_TYPES = ("q8_0", *QUANT_TYPES)


def llama_quantize(src: Path, out: Path, kind: str, threads: int) -> Path:
    """llama.cpp's quantizer (llama_model_quantize): SRC into OUT as KIND, a key of QUANT_TYPES
    (q4_K: every tensor q4_K, as `llama-quantize --pure`; Q4_K_M, IQ4_XS...: llama.cpp's mix)."""
    import ctypes

    import llama_cpp

    ftype, pure = QUANT_TYPES[kind]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.pure = pure
    params.nthread = threads
    tmp = out.with_suffix(".partial")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed (rc {rc})")
    tmp.replace(out)
    return out


def gguf_path(args, threads: int) -> Path | None:
    """The GGUF to time: --gguf, else the cached conversion of --gguf-type, else convert now
    (None: cannot, with the reason printed)."""
    if args.gguf:
        return Path(args.gguf)
    cached = Path(args.model) / gguf_name(args.gguf_type)
    if cached.is_file():
        return cached
    src = find_converter(args.llama_cpp_src)
    if src is None:
        print(
            f"llama.cpp: skipped (no {cached.name} in the model dir and no converter: pass "
            "--llama-cpp-src DIR, an unpacked llama.cpp or llama-cpp-python source tree)"
        )
        return None
    print(f"llama.cpp: converting to {cached} with {src}/convert_hf_to_gguf.py (once)")
    t0 = time.perf_counter()
    if args.gguf_type == "q8_0":
        convert(args.model, cached, src, "q8_0")
    else:
        bf16 = convert(args.model, cached.with_name("model-bf16.gguf"), src, "bf16")
        llama_quantize(bf16, cached, args.gguf_type, threads)
        bf16.unlink()
    print(f"llama.cpp: converted in {time.perf_counter() - t0:.0f} s")
    return cached


def import_llama():
    """llama_cpp.Llama, or `Unavailable` with the real reason: a dependency it lacks (with
    --no-deps, diskcache), a library that does not load."""
    from hetserve.bench.common import Unavailable

    try:
        from llama_cpp import Llama
    except ModuleNotFoundError as exc:
        if exc.name == "llama_cpp":
            raise Unavailable(
                "llama-cpp-python is not installed (pip install llama-cpp-python builds it "
                "from source, 10-20 minutes)"
            ) from None
        raise Unavailable(f"llama_cpp does not import: {exc} (pip install {exc.name})") from None
    except (ImportError, OSError) as exc:
        raise Unavailable(f"llama_cpp does not import: {exc}") from None
    return Llama


def rate(args, ids: list[int], threads: int, bar) -> float | None:
    """Decode tokens/s of llama.cpp on the GGUF, or None (with the reason printed)."""
    from hetserve.bench.common import Unavailable

    try:
        Llama = import_llama()  # noqa: N806 (a class)
    except Unavailable as exc:
        print(f"llama.cpp: not run: {exc}")
        return None

    path = gguf_path(args, threads)
    if path is None:
        return None
    llm = Llama(
        model_path=str(path),
        n_ctx=len(ids) + args.tokens + 16,
        n_batch=max(len(ids), 8),
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )

    def decode_seconds(n: int) -> float:
        """Seconds from the first sampled token to the n-th, in one generate: decode alone.
        (N - 1) / (t(N) - t(1)) over two calls, as the other rows, drowns at long prompts:
        every call prefills again (llama.cpp keeps no prefix cache between calls here), and
        a 4,000-token prefill's noise exceeded 32 tokens' decode (the rate then fell back to
        the end-to-end one, 1 tok/s)."""
        llm.reset()
        # Llama.generate yields sampled tokens forever (EOS does not stop it); temp 0 is greedy
        gen = llm.generate(ids, temp=0.0, top_k=1, reset=True)
        next(gen)
        t0 = time.perf_counter()
        for _ in range(n - 1):
            next(gen)
        seconds = time.perf_counter() - t0
        gen.close()
        return seconds

    try:
        decode_seconds(2)  # warm-up: buffers allocated, the file's pages read
        best = float("inf")
        for _ in range(args.repeats):
            best = min(best, decode_seconds(args.tokens))
            if bar is not None:
                bar.update(2)  # the two calls the other rows make per repeat
        return (args.tokens - 1) / best
    finally:
        llm.close()
