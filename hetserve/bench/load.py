"""`hetserve bench load`: what loading a model costs, hetserve on each format vs llama.cpp.

For one model, each of: hetserve on a q8_0 GGUF, on the safetensors checkpoint, on a
`hetserve convert --quant int8` checkpoint (kernel layout: mapped; its first load, digests
checked, HETSERVE_VERIFY_CONVERTED=always; and the loads after it, which map the file without
reading it, the default once a load has checked it), and llama.cpp (llama-cpp-python) on the
same GGUF. Each load runs in a fresh subprocess: the seconds until the system is ready to
serve (hetserve: `LLM(...)` returned, its start-up probe included, and of it `build_model`,
the weights; llama.cpp: `Llama(...)` returned), then one short greedy generate (so pages a
lazy load leaves for the first token are in, as llama.cpp's mmap does; the seconds from the
start to those tokens are a column of their own), then the process's resident memory (VmRSS,
and of it file pages) and peak (VmHWM). The files are read once before the timed rounds (page
cache warm: the load time is then the loader's, not the disk's), and the best of --rounds is
kept (every round is in the JSON).

Ratios: hetserve's resident over llama.cpp's on the same GGUF, peak over resident, each
hetserve row's resident against its own served bytes + KV cache + 300 MB (issue 42's bound),
and each load's seconds over llama.cpp's. The GGUF is the one `bench decode` uses (cached
as MODEL/model-q8_0.gguf, converted once with llama.cpp's converter: --llama-cpp-src), or
--gguf; the converted checkpoint is --converted, else made once in MODEL/converted-int8.
A system that cannot run here is a row with its reason.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from hetserve.bench.common import model_dir, print_table, write_json

VERIFY = "HETSERVE_VERIFY_CONVERTED"  # envs.verify_converted
ALLOWANCE = 300 << 20  # issue 42: resident <= served bytes + KV + 300 MB
_MIB = 1 << 20

# One load in a fresh interpreter: argv = system, path, threads, context. Prints one JSON line.
_CHILD = r"""
import json, sys, time

def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out

system, path, threads, ctx = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ids = [11, 12, 13, 14, 15, 16, 17, 18]
if system == "llama.cpp":
    from llama_cpp import Llama
    before = status()
    t0 = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=ctx, n_batch=ctx, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    load = time.perf_counter() - t0
    gen = llm.generate(ids, temp=0.0, top_k=1, reset=True)
    for _ in range(4):
        next(gen)
    gen.close()
    first = time.perf_counter() - t0 - load
    served = None
else:
    import torch
    torch.set_num_threads(threads)
    from hetserve import LLM, SamplingParams
    import hetserve.engine.core as core, hetserve.model.build  # the runtime, before any weight
    build, weights = core.build_model, []

    def timed(*a, **k):  # the weights' part of the start-up (the rest: KV, probe, tokenizer)
        t = time.perf_counter()
        model = build(*a, **k)
        weights.append(time.perf_counter() - t)
        return model

    core.build_model = timed
    before = status()
    t0 = time.perf_counter()
    llm = LLM(model=path, device="cpu", max_model_len=ctx, num_kv_blocks=ctx // 16 + 1)
    load = time.perf_counter() - t0
    llm.generate(prompt_token_ids=ids,
                 sampling_params=SamplingParams(max_tokens=4, min_tokens=4, temperature=0))
    first = time.perf_counter() - t0 - load
    m = llm.memory
    served = {"experts": m.experts, "dense": m.dense, "kv_cache": m.kv_cache}
    load = {"ready_s": load, "weights_s": weights[0]}
after = status()
if not isinstance(load, dict):
    load = {"ready_s": load, "weights_s": load}  # llama.cpp: Llama() is its whole start-up
load["first_tokens_s"] = load["ready_s"] + first  # start to 4 tokens of an 8-token prompt
print(json.dumps({**load, "before": before, "after": after, "served": served}))
"""


def register(sub) -> None:
    p = sub.add_parser(
        "load", help="load seconds, resident and peak memory per format vs llama.cpp"
    )
    p.add_argument("--model", default=None, help="HF model directory (safetensors)")
    p.add_argument("--gguf", default=None, help="a q8_0 GGUF of the model (default: converted)")
    p.add_argument("--converted", default=None, help="a `hetserve convert` output directory")
    p.add_argument("--llama-cpp-src", default=None, help="llama.cpp source (its GGUF converter)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=256, help="KV cache tokens, both systems")
    p.add_argument("--rounds", type=int, default=2, help="loads per system (best kept)")
    p.add_argument("--json", "--result-file", dest="json", default=None, help="write JSON here")
    p.set_defaults(func=run)


def _converted(args, model: Path) -> tuple[Path | None, str | None]:
    """--converted, else MODEL/converted-int8; made once (in a subprocess) where missing."""
    out = Path(args.converted) if args.converted else model / "converted-int8"
    if not (out / "config.json").is_file():
        print(f"converting {model} to {out} (once)")
        cmd = [sys.executable, "-m", "hetserve.cli", "convert", "--quant", "int8",
               str(model), str(out)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if ln.strip()] or ["?"]
            return None, f"convert failed: {lines[-1][:200]}"
    return out, None


def _gguf(args) -> tuple[Path | None, str | None]:
    """The GGUF to load, or None and why not."""
    from hetserve.bench.decode_llamacpp import gguf_path

    ns = argparse.Namespace(gguf=args.gguf, model=args.model, gguf_type="q8_0",
                            llama_cpp_src=args.llama_cpp_src)  # fmt: skip
    path = gguf_path(ns, args.threads)
    return (path, None) if path else (None, "no GGUF: pass --gguf or --llama-cpp-src")


def _one(system: str, path: Path, args, env: dict[str, str] | None) -> dict:
    import os

    cmd = [sys.executable, "-c", _CHILD, system, str(path), str(args.threads), str(args.context)]
    environ = {**os.environ, **(env or {})}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=environ)
    if out.returncode != 0:
        tail = [ln for ln in out.stderr.strip().splitlines() if ln.strip()][-1:] or ["?"]
        return {"error": f"rc {out.returncode}: {tail[0][:200]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure(
    system: str, path: Path | None, reason: str | None, args, env: dict[str, str] | None = None
) -> dict:
    """Best-of-rounds for one system (by load seconds), every round kept; `env`: variables
    the child runs with."""
    if path is None:
        return {"system": system, "error": reason}
    if system == "llama.cpp":
        from hetserve.bench.common import Unavailable
        from hetserve.bench.decode_llamacpp import import_llama

        try:
            import_llama()
        except Unavailable as exc:
            return {"system": system, "path": str(path), "error": str(exc)}
    files = [path] if path.is_file() else sorted(path.iterdir())
    for f in files:  # warm the page cache: every round then times the loader, not the disk
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass
    rounds = [_one(system, path, args, env) for _ in range(args.rounds)]
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return {"system": system, "path": str(path), "error": rounds[-1]["error"]}
    best = min(ok, key=lambda r: r["ready_s"])
    disk = sum(f.stat().st_size for f in files if f.is_file() and f.suffix != ".json")
    return {"system": system, "path": str(path), "disk_bytes": disk, **best, "rounds": rounds}


def ratios(r: dict, peer: dict | None) -> dict[str, float | None]:
    """The bench's ratios for one system against llama.cpp's row (None where either is
    missing): resident and growth since imports, weights and ready seconds, peak/resident,
    resident over the issue's bound, and the peak's growth over the process before the load
    against the bytes on disk (issue 38's goal for a GGUF: <= 1.2)."""
    if "error" in r:
        return {}
    after, served = r["after"], r.get("served")
    rss = after["VmRSS"]
    bound = None if served is None else sum(served.values()) + r["before"]["VmRSS"] + ALLOWANCE
    out: dict[str, float | None] = {
        "peak_over_resident": after["VmHWM"] / rss,
        "resident_over_bound": None if bound is None else rss / bound,
        "peak_grown_over_disk": (after["VmHWM"] - r["before"]["VmRSS"]) / max(r["disk_bytes"], 1),
    }
    ok = peer is not None and "error" not in peer
    for key, get in (
        ("resident", lambda x: x["after"]["VmRSS"]),
        ("grown", _grown),
        ("weights_s", lambda x: x["weights_s"]),
        ("ready_s", lambda x: x["ready_s"]),
        ("first_tokens_s", lambda x: x["first_tokens_s"]),
    ):
        out[f"{key}_vs_llama_cpp"] = get(r) / max(get(peer), 1e-9) if ok else None
    return out  # fmt: skip


def _grown(r: dict) -> int:
    return r["after"]["VmRSS"] - r["before"]["VmRSS"]


HEADERS = ["system", "disk MiB", "weights s", "ready s", "4 tokens s", "resident MiB",
           "grown MiB", "file MiB", "peak MiB", "peak/res", "peak grown/disk", "res/bound",
           "res vs llama.cpp", "grown vs llama.cpp", "weights s vs llama.cpp",
           "4 tokens s vs llama.cpp"]  # fmt: skip


def _row(r: dict, peer: dict | None) -> list:
    if "error" in r:  # a system that could not run (llama.cpp not installed): its name only
        return [r["system"], "not run"] + [None] * (len(HEADERS) - 2)
    q, after = r["ratios"], r["after"]

    def rnd(v: float | None) -> float | None:
        return None if v is None else round(v, 2)

    return [
        r["system"], round(r["disk_bytes"] / _MIB), rnd(r["weights_s"]), rnd(r["ready_s"]),
        rnd(r["first_tokens_s"]), round(after["VmRSS"] / _MIB), round(_grown(r) / _MIB),
        round(after.get("RssFile", 0) / _MIB), round(after["VmHWM"] / _MIB),
        rnd(q["peak_over_resident"]), rnd(q["peak_grown_over_disk"]),
        rnd(q["resident_over_bound"]),
        rnd(q["resident_vs_llama_cpp"]), rnd(q["grown_vs_llama_cpp"]),
        rnd(q["weights_s_vs_llama_cpp"]), rnd(q["first_tokens_s_vs_llama_cpp"]),
    ]  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from hetserve.errors import InvalidInputError

    if args.rounds < 1 or args.threads < 1 or args.context < 16:
        raise InvalidInputError("--rounds and --threads must be >= 1 and --context >= 16")
    args.model = model_dir(args)
    model = Path(args.model)
    gguf, why = _gguf(args)
    converted = _converted(args, model)
    t0 = time.perf_counter()
    results = [
        _measure("hetserve gguf", gguf, why, args),
        _measure("hetserve safetensors", model, None, args),
        _measure("hetserve converted, first load", *converted, args, {VERIFY: "always"}),
        # the default after a first load checked it: pages then come in at the first forward,
        # as llama.cpp's do
        _measure("hetserve converted", *converted, args),
        _measure("llama.cpp", gguf, why, args),
    ]
    peer = results[-1]
    for r in results:
        r["ratios"] = ratios(r, peer)
    print_table(HEADERS, [_row(r, peer) for r in results])
    for r in results:
        if "error" in r:
            print(f"{r['system']}: not run: {r['error']}")
    print(
        "weights s: hetserve's build_model (ready s adds the engine's start-up: KV cache, step "
        "probe); llama.cpp: Llama() for both. 4 tokens s: from the start of the load to 4 "
        "tokens generated for an 8-token prompt. grown: resident since the imports. file: "
        "resident pages of mapped files. peak grown: the peak over the process before the load. "
        "bound = resident after imports + served bytes + KV cache + 300 MB. Goals (issue 42): "
        "res/bound <= 1, peak/res <= 1.2, res vs llama.cpp <= 1.1 on the same GGUF, converted "
        "weights s vs llama.cpp <= 1; (issue 38) a GGUF's peak grown/disk <= 1.2"
    )
    write_json(args.json, {"benchmark": "load", "model": str(model), "threads": args.threads,
                           "context": args.context, "seconds": time.perf_counter() - t0,
                           "results": results})  # fmt: skip
    return 0
