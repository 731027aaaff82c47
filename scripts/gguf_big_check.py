"""Issue 38's big-file check: a Qwen3-30B-A3B-shaped GGUF with llama.cpp Q4_K_M's tensor types
(~17 GB of random blocks, streamed to disk with `gguf` one tensor at a time), loaded and decoded
by hetserve in a child process whose resident and peak memory are read from /proc; the file is
deleted after. Not a test: it needs ~20 GB of disk and most of a 24 GiB box's memory. `--dir`
must be on a disk, not tmpfs (there the file itself would take memory, and the loader's
release of the file's pages would free nothing).

    .venv/bin/python scripts/gguf_big_check.py [--dir /tmp/gguf-30b] [--layers 48] [--keep]

The file's blocks and types: hetserve/testing/random_gguf.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hetserve.testing.random_gguf import SHAPE, write_random_q4km

CHILD = r"""
import json, sys, time
import torch, hetserve.model.build, hetserve.engine.core
from hetserve import LLM, SamplingParams
from hetserve.model.memory_facts import proc_memory as status
before = status()
t0 = time.perf_counter()
llm = LLM(sys.argv[1], max_model_len=256, num_kv_blocks=32)
loaded = time.perf_counter() - t0
after = status()
p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
t1 = time.perf_counter()
out = llm.generate(prompt_token_ids=[65, 66, 67, 68], sampling_params=p)[0]
gen = time.perf_counter() - t1
print(json.dumps({"before": before, "after_load": after, "end": status(), "load_s": loaded,
                  "generate_8_s": gen, "tokens": out.token_ids}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/gguf-30b")
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    ap.add_argument("--keep", action="store_true", help="keep the file")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    cfg = {**SHAPE, "num_hidden_layers": args.layers}
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "model-Q4_K_M.gguf"
    t = time.perf_counter()
    try:
        size = write_random_q4km(path, cfg, progress=True)
        print(
            f"wrote {path}: {size / 2**30:.2f} GiB in {time.perf_counter() - t:.0f} s", flush=True
        )
        env = dict(os.environ)
        proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True,
                              text=True, env=env)  # fmt: skip
        sys.stderr.write(proc.stderr[-3000:])
        if proc.returncode != 0:
            print(f"child exited {proc.returncode}")
            return 1
        got = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:  # a write or a load that failed half-way leaves no 17 GB behind either
        if not args.keep and path.exists():
            path.unlink()
    base = got["before"]["VmRSS"]
    peak, res = got["end"]["VmHWM"] - base, got["after_load"]["VmRSS"] - base
    gib = 2**30
    print(
        f"file {size / gib:.2f} GiB; load {got['load_s']:.0f} s; resident after load "
        f"{res / gib:.2f} GiB ({res / size:.2f}x the file), peak {peak / gib:.2f} GiB "
        f"({peak / size:.2f}x), over {base / gib:.2f} GiB at start; 8 tokens in "
        f"{got['generate_8_s']:.1f} s: {got['tokens']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"file_bytes": size, "layers": args.layers, **got},
                                              indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
