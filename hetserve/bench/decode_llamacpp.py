"""The llama.cpp peer of `bench decode`: a q8_0 GGUF converted from the same HF weights, timed
through llama-cpp-python. Optional: without the package the peer is skipped with the reason.

The conversion runs llama.cpp's own `convert_hf_to_gguf.py` (in the llama-cpp-python sdist under
vendor/llama.cpp) in a subprocess, once; the GGUF is cached next to the model. Its one change: a
BPE pre-tokenizer the converter does not know by hash (every tokenizer trained offline, like the
tiny models') is written as "gpt-2", the byte-level regex split our tokenizers use. The bench
feeds token ids, so the pre-tokenizer never runs; it only has to be a name llama.cpp accepts.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

SKIP_MESSAGE = "llama.cpp: skipped (pip install llama-cpp-python builds from source, ~8 min)"
GGUF_NAME = "model-q8_0.gguf"

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


def convert_q8_0(model: str | Path, out: str | Path, src: Path) -> Path:
    """Write a q8_0 GGUF of MODEL to OUT with llama.cpp's converter; raises on failure."""
    out = Path(out)
    tmp = out.with_suffix(".partial")
    cmd = [sys.executable, "-c", _CONVERT, str(src), str(model), "--outtype", "q8_0",
           "--outfile", str(tmp)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed (rc {proc.returncode}):\n{tail}")
    tmp.replace(out)  # a killed conversion never leaves a GGUF that looks complete
    return out


def _gguf_path(args) -> Path | None:
    """The GGUF to time: --gguf, else the cached conversion, else convert now (None: cannot)."""
    if args.gguf:
        return Path(args.gguf)
    cached = Path(args.model) / GGUF_NAME
    if cached.is_file():
        return cached
    src = find_converter(args.llama_cpp_src)
    if src is None:
        print(
            f"llama.cpp: skipped (no {GGUF_NAME} in the model dir and no converter: pass "
            "--llama-cpp-src DIR, an unpacked llama.cpp or llama-cpp-python source tree)"
        )
        return None
    print(f"llama.cpp: converting to {cached} with {src}/convert_hf_to_gguf.py (once)")
    t0 = time.perf_counter()
    convert_q8_0(args.model, cached, src)
    print(f"llama.cpp: converted in {time.perf_counter() - t0:.0f} s")
    return cached


def rate(args, ids: list[int], threads: int, bar) -> float | None:
    """Decode tokens/s of llama.cpp on the q8_0 GGUF, or None (with the reason printed)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print(SKIP_MESSAGE)
        return None
    from hetserve.bench.common import decode_rate

    path = _gguf_path(args)
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

    def make(n: int):
        def go() -> None:
            llm.reset()  # no prompt reuse between runs: every run prefills, as the others do
            # Llama.generate yields sampled tokens forever (EOS does not stop it); temp 0 is
            # greedy. Stop after n.
            gen = llm.generate(ids, temp=0.0, top_k=1, reset=True)
            for _ in range(n):
                next(gen)
            gen.close()

        return go

    try:
        return decode_rate(make, args.tokens, args.repeats, bar)
    finally:
        llm.close()
