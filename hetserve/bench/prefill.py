"""`hetserve bench prefill`: prompt tokens/s of hetserve against llama.cpp and transformers on the
same weights, at several prompt lengths, in one run; beside them this machine's measured limits.

Systems (prefill_systems.py): hetserve all-int8, all-int8 with int8 activations (`w8a8`:
`--activation-bits 8`), hybrid and fp32 (`--placement device`) on the HF checkpoint, hetserve
on the GGUF llama.cpp reads, llama.cpp (llama-cpp-python) on that GGUF, transformers fp32.
Each is loaded in its own round, times one prompt per length (best of `--repeats`) and is freed
before the next loads; the plan runs `--rounds` times, reversed every other round, every
round's rates are in the JSON and each system keeps its best. A system that
cannot run is a row with its reason (a peer that does not import says why).

Limits (peaks.py), measured before and after the systems (best of the two): the int8, int16,
fp32 and bf16 multiply-add rates of this CPU on the bench's threads, and its read bandwidth.
Every row's `of peak` is the model's arithmetic for that prompt (prefill_systems.prompt_ops:
routed experts, other linears, causal attention) times its rate over the peak of the
arithmetic it mostly runs (int8 for hetserve's int8 presets and llama.cpp's quantized types,
fp32 otherwise). `kernels` (prefill_kernels.py) times the expert GEMM, the int8 linear and
causal attention (torch SDPA against the native paged kernel) at the model's shapes alone,
against the same peaks.
"""

from __future__ import annotations

import argparse
import gc
import json
from collections.abc import Callable
from pathlib import Path

from hetserve import envs
from hetserve.bench.common import print_table, require_at_least, write_json
from hetserve.bench.decode_llamacpp import GGUF_TYPES

DEFAULT_LENS = "512,2048,8192"
SYSTEMS = ("all-int8", "w8a8", "hybrid", "fp32", "gguf", "llama.cpp", "transformers")
# The arithmetic each system mostly runs, whose peak its row is read against.
_PEAK_KIND = {"hetserve all-int8": "int8", "hetserve all-int8 w8a8": "int8",
              "hetserve gguf": "int8", "llama.cpp": "int8"}  # fmt: skip


def register(sub) -> None:
    p = sub.add_parser("prefill", help="prompt tokens/s vs llama.cpp and transformers, vs peaks")
    p.add_argument("--model", required=True, help="HF model directory (a MoE checkpoint)")
    p.add_argument("--prompt-lens", default=None,
                   help=f"comma-separated (default {DEFAULT_LENS}: those that fit)")  # fmt: skip
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"of {', '.join(SYSTEMS)}")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (best kept)")
    p.add_argument("--repeats", type=int, default=2, help="timed prompts per length and round")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for every system")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="hetserve's prefill chunk (default: the engine's)")  # fmt: skip
    p.add_argument("--hf-max-len", type=int, default=2048,
                   help="longest prompt transformers is timed at (slow at long ones)")  # fmt: skip
    p.add_argument("--gguf", default=None, help="GGUF to time (default MODEL/model-TYPE.gguf)")
    p.add_argument("--gguf-type", choices=GGUF_TYPES, default="q8_0")
    p.add_argument("--llama-cpp-src", default=envs.llama_cpp_src(),
                   help="llama.cpp source tree with convert_hf_to_gguf.py")  # fmt: skip
    p.add_argument("--llama-batch", type=int, default=2048, help="llama.cpp n_batch")
    p.add_argument("--llama-ubatch", type=int, default=512, help="llama.cpp n_ubatch")
    p.add_argument("--kernel-tokens", default="512,2048",
                   help="token counts of the kernels table ('' skips it)")  # fmt: skip
    p.add_argument("--peak-seconds", type=float, default=0.2,
                   help="length of each arithmetic peak measurement")  # fmt: skip
    p.add_argument("--bandwidth-mib", type=int, default=256, help="read probe buffer size")
    p.add_argument("--json", "--result-file", dest="json", default=None)
    p.set_defaults(func=run)


def _parse(args) -> tuple[dict, list[int], list[str]]:
    from hetserve.errors import InvalidInputError, ModelNotFoundError

    path = Path(args.model) / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"no config.json in {args.model!r}: pass an HF model directory")
    given = args.prompt_lens
    try:
        lens = sorted({int(x) for x in (DEFAULT_LENS if given is None else given).split(",")
                       if x.strip()})  # fmt: skip
    except ValueError:
        raise InvalidInputError(f"--prompt-lens: not integers: {args.prompt_lens!r}") from None
    if not lens or lens[0] < 1:
        raise InvalidInputError("--prompt-lens: give one or more positive lengths")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise InvalidInputError(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    if args.rounds < 1 or args.repeats < 1:
        raise InvalidInputError("--rounds and --repeats must be at least 1")
    cfg = json.loads(path.read_text())
    context = cfg.get("max_position_embeddings")
    if context and given is None:  # the defaults the model's context holds (one token past)
        lens = [n for n in lens if n < context] or [context - 1]
    if context and lens[-1] >= context:  # one generated token must fit as well
        raise InvalidInputError(
            f"--prompt-lens: {lens[-1]} tokens do not fit the model's context of {context}"
        )
    return cfg, lens, systems


def _plan(args, systems: list[str], prompts: dict[int, list[int]], threads: int):
    from hetserve.bench import prefill_systems as ps

    model = str(args.model)
    table: dict[str, Callable[[], dict[int, float]]] = {
        "all-int8": lambda: ps.hetserve_rates(args, prompts, "all-int8", model),
        "w8a8": lambda: ps.hetserve_rates(args, prompts, "all-int8", model, activation_bits=8),
        "hybrid": lambda: ps.hetserve_rates(args, prompts, "hybrid", model),
        "fp32": lambda: ps.hetserve_rates(args, prompts, "device", model),
        "gguf": lambda: ps.hetserve_gguf_rates(args, prompts, threads),
        "llama.cpp": lambda: ps.llamacpp_rates(args, prompts, threads),
        "transformers": lambda: ps.transformers_rates(args, prompts),
    }
    names = {"all-int8": "hetserve all-int8", "w8a8": "hetserve all-int8 w8a8",
             "hybrid": "hetserve hybrid",
             "fp32": "hetserve fp32", "gguf": "hetserve gguf", "llama.cpp": "llama.cpp",
             "transformers": "transformers"}  # fmt: skip
    return [(names[s], table[s]) for s in systems]


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from hetserve.bench.peaks import measure_peaks
    from hetserve.bench.prefill_kernels import kernel_rows
    from hetserve.bench.prefill_systems import Unavailable
    from hetserve.model.synthetic import make_prompts

    cfg, lens, systems = _parse(args)
    require_at_least(args, 1, "threads", "bandwidth_mib")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    prompts = dict(zip(lens, make_prompts(args.model, len(lens), 0, lengths=lens), strict=True))
    peaks = measure_peaks(threads, args.bandwidth_mib, args.peak_seconds)
    plan = _plan(args, systems, prompts, threads)
    rounds: dict[str, list[dict[int, float] | None]] = {name: [] for name, _ in plan}
    reasons: dict[str, str] = {}
    with tqdm(total=len(plan) * args.rounds, desc="bench prefill", unit="system") as bar:
        for r in range(args.rounds):
            for name, fn in plan if r % 2 == 0 else plan[::-1]:
                bar.set_postfix_str(f"{name} (round {r + 1})")
                if name in reasons:
                    rounds[name].append(None)
                else:
                    try:
                        rounds[name].append(fn())
                    except Unavailable as exc:
                        reasons[name] = str(exc)
                        rounds[name].append(None)
                gc.collect()  # its weights go before the next system loads (RAM holds one)
                bar.update(1)
    kernels = kernel_rows(cfg, args.kernel_tokens, threads, peaks)
    peaks = peaks.best(measure_peaks(threads, args.bandwidth_mib, args.peak_seconds))
    report = build_report(args, cfg, lens, rounds, reasons, peaks, threads)
    report["kernels"] = kernels
    print_report(report)
    write_json(args.json, report)
    return 0


def _best(runs: list[dict[int, float] | None], n: int) -> float | None:
    got = [r[n] for r in runs if r and n in r]
    return max(got) if got else None


def build_report(args, cfg: dict, lens: list[int], rounds: dict, reasons: dict[str, str],
                 peaks, threads: int) -> dict:  # fmt: skip
    from hetserve.bench.prefill_systems import prompt_ops

    rates = {name: {n: _best(rs, n) for n in lens} for name, rs in rounds.items()}
    rows = []
    for name, by_len in rates.items():
        kind = _PEAK_KIND.get(name, "fp32")
        peak = peaks.gops.get(kind)
        for n in lens:
            rate, ll, hf = by_len[n], rates.get("llama.cpp", {}).get(n), None
            hf = rates.get("transformers", {}).get(n)
            ops = prompt_ops(cfg, n)
            achieved = sum(ops.values()) / n * rate / 1e9 if ops and rate else None
            rows.append({
                "system": name, "prompt_len": n, "tokens_per_s": rate,
                "vs_llamacpp": rate / ll if rate and ll else None,
                "vs_transformers": rate / hf if rate and hf else None,
                "gops": achieved, "peak_kind": kind,
                "of_peak": achieved / peak if achieved and peak else None,
                "unavailable": reasons.get(name),
            })  # fmt: skip
    return {
        "benchmark": "prefill",
        "model": str(args.model),
        "prompt_lens": lens,
        "threads": threads,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "llama_cpp": {"n_batch": args.llama_batch, "n_ubatch": args.llama_ubatch,
                      "gguf_type": args.gguf_type if args.gguf is None else "file",
                      "system_info": _llama_system_info()},
        "rows": rows,
        "rounds_tokens_per_s": rounds,
        "unavailable": reasons,
        "peaks": peaks.to_dict(),
        "ops_per_prompt": {n: prompt_ops(cfg, n) for n in lens},
    }  # fmt: skip


def print_report(report: dict) -> None:
    rows = [
        [r["system"], r["prompt_len"], r["tokens_per_s"], r["vs_llamacpp"], r["vs_transformers"],
         r["of_peak"], r["peak_kind"]]
        for r in report["rows"]
    ]  # fmt: skip
    headers = ["system", "prompt", "tok/s", "vs llama.cpp", "vs transformers", "of peak", "peak"]
    print_table(headers, rows)
    for name, why in report["unavailable"].items():
        print(f"{name}: not run: {why}")
    p = report["peaks"]
    gops = ", ".join(f"{k} {v:.0f}" if v else f"{k} -" for k, v in p["gops"].items())
    print(f"peaks on {p['threads']} threads ({p['isa'] or p['note']}): GOPS {gops}; "
          f"read {p['read_gbps']:.1f} GB/s")  # fmt: skip
    if report.get("kernels"):
        krows = [[k["kernel"], k["tokens"], k["gops"], k["of_peak"], k["peak_kind"],
                  k.get("vs_peer")] for k in report["kernels"]]  # fmt: skip
        print_table(["kernel", "tokens", "GOPS", "of peak", "peak", "vs peer"], krows)


def _llama_system_info() -> str | None:
    """What the llama.cpp build in use runs on ("AVX = 1 | AVX2 = 1 | AVX512 = 0 | ..."), so a
    run against a build limited to AVX2 says so; None where llama_cpp does not import."""
    try:
        import llama_cpp

        return llama_cpp.llama_print_system_info().decode().strip()
    except Exception:  # noqa: BLE001 (any failure: the row of llama.cpp says why)
        return None
