"""`hetserve bench decode`: single-stream decode tokens/s of hetserve vs its peers, in one run.

Systems, each loaded inside its own function so its weights are freed before the next loads:
hetserve hybrid (routed experts on the cpu-int8 kernel), hetserve fp32 reference (`device`),
transformers `generate` (fp32), llama.cpp on a GGUF of the same weights (q8_0, or q4_K;
llama-cpp-python, optional) and hetserve on that same GGUF file (its experts on the backend of
their GGUF type, the other linears int8 on a CPU-only machine). Decode rate is
(N - 1) / (t(N tokens) - t(1 token)), best of repeats, so prefill and start-up cancel out; all run
greedy with EOS ignored on the same prompt ids. The whole plan runs `--rounds` times, in reverse
order every other round, and each system keeps its best round (every round's rate is in the JSON).

Next to the rates: the routed-expert bytes each decoded token streams at int8 (top_k experts of
every MoE layer) and the GB/s that implies for the hybrid run, against this machine's memory read
bandwidth measured in the same run: the fraction of the roofline the expert kernel reaches.
"""

from __future__ import annotations

import argparse
import gc
import json
from collections.abc import Callable
from functools import cache
from pathlib import Path

from hetserve import envs
from hetserve.bench.common import decode_rate, require_at_least, write_json
from hetserve.bench.decode_llamacpp import GGUF_TYPES
from hetserve.bench.decode_report import build_report, kv_logprob_errors, print_report
from hetserve.bench.peaks import measure_bandwidth

LLAMACPP_SRC_ENV = envs.LLAMA_CPP_SRC


def register(sub) -> None:
    p = sub.add_parser("decode", help="decode tokens/s: hetserve hybrid vs transformers, llama.cpp")
    p.add_argument(
        "--model",
        required=True,
        help="HF model directory (a MoE checkpoint), or a .gguf file as downloaded (then only "
        "llama.cpp and hetserve on that file are timed); `hetserve models make-tiny --arch "
        "qwen3-moe DIR` writes a small random one to try it on (docs/benchmarks.md)",
    )
    p.add_argument("--tokens", type=int, default=32, help="tokens to decode per run")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per system (best is kept)")
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="times every system is loaded and timed, in alternating order (best round kept): "
        "a busy minute on a shared machine then does not penalize one system alone",
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads for every system")
    p.add_argument("--json", "--result-file", dest="json", default=None, help="write JSON here")
    p.add_argument("--skip-hf", action="store_true", help="skip transformers")
    p.add_argument("--skip-reference", action="store_true", help="skip hetserve fp32 reference")
    p.add_argument(
        "--skip-all-int8",
        action="store_true",
        help="skip hetserve with int8 non-expert linears too (CPU-only machines)",
    )
    p.add_argument("--skip-llamacpp", action="store_true", help="skip llama.cpp")
    p.add_argument("--skip-cpu-int8", action="store_true", help="skip hetserve hybrid (cpu-int8)")
    p.add_argument(
        "--kv-cache-dtypes",
        default="auto",
        help="comma-separated --kv-cache-dtype values hetserve all-int8 runs with, one row each "
        "(e.g. float32,float16,int8; llama.cpp keeps its own f16 cache)",
    )
    p.add_argument(
        "--gguf", default=None, help="GGUF to time (default MODEL/model-<--gguf-type>.gguf)"
    )
    p.add_argument(
        "--gguf-type",
        choices=GGUF_TYPES,
        default="q8_0",
        help="GGUF to make when --gguf is not given: q8_0 (converter), q4_K (llama.cpp's "
        "quantizer, every tensor q4_K) or a mix as downloaded (Q4_K_M, IQ4_XS...)",
    )
    p.add_argument(
        "--skip-gguf-hetserve", action="store_true", help="skip hetserve on the GGUF file"
    )
    p.add_argument(
        "--llama-cpp-src",
        default=envs.llama_cpp_src(),
        help=f"llama.cpp source tree with convert_hf_to_gguf.py (or ${LLAMACPP_SRC_ENV})",
    )
    p.add_argument("--bandwidth-mib", type=int, default=256, help="bandwidth probe buffer size")
    p.add_argument(
        "--numa",
        choices=("off", "auto", "both"),
        default="off",
        help="hetserve's --numa for the cpu-int8 and all-int8 rows; both: each of them twice, "
        "off and auto, with the auto/off ratio",
    )
    p.add_argument(
        "--activation-bits",
        type=int,
        choices=(8, 16),
        default=16,
        help="hetserve's --activation-bits for its int8 rows (8: W8A8, the rows named so)",
    )
    p.add_argument(
        "--streams",
        default=None,
        help="comma-separated concurrent stream counts (e.g. 1,4,16,32): hetserve's batched "
        "decode at each, against this machine's roofline, instead of the single-stream systems",
    )
    p.set_defaults(func=run)


# --- roofline arithmetic ---------------------------------------------------------------------


# --- timing ------------------------------------------------------------------------------------


@cache
def _all_int8_rules(expert_backend: str = "cpu-int8") -> str:
    """A rules file: routed experts on `expert_backend`, every other linear int8 (the
    `all-int8` preset with a backend of the caller's choosing; tests compare backends so).
    One file per backend and process, removed when the process exits."""
    import atexit
    import tempfile

    import yaml

    rules = [
        {
            "name": "routed-experts",
            "match": r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts",
            "device": "cpu",
            "backend": expert_backend,
        },
        {"name": "int8-linears", "match": ".*", "device": "cpu", "backend": "cpu-int8"},
    ]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump({"rules": rules}, f)
    atexit.register(Path(f.name).unlink, missing_ok=True)
    return f.name


def _hetserve_rate(
    args,
    ids: list[int],
    bar,
    placement: str,
    model=None,
    kv_dtype: str = "auto",
    logprobs: dict[str, list[float]] | None = None,
    numa: str = "off",
) -> float:
    """Decode tok/s; with `logprobs`, also the prompt's logprobs under `kv_dtype` (once)."""
    from hetserve import LLM, SamplingParams

    kwargs: dict = {"cpu_threads": args.threads} if args.threads else {}
    kwargs["kv_cache_dtype"] = kv_dtype
    kwargs["numa"] = numa
    if placement != "device":
        kwargs["activation_bits"] = args.activation_bits
    llm = LLM(str(model or args.model), placement=placement, **kwargs)

    def make(n: int) -> Callable[[], object]:
        params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True)
        return lambda: llm.generate(prompt_token_ids=[ids], sampling_params=params)

    rate = decode_rate(make, args.tokens, args.repeats, bar)
    if logprobs is not None and kv_dtype not in logprobs:
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        out = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0]
        pairs = zip(out.prompt_logprobs[1:], ids[1:], strict=True)
        logprobs[kv_dtype] = [d[t].logprob for d, t in pairs]
    return rate


def _hf_rate(args, ids: list[int], bar) -> float | None:
    try:
        import transformers
    except ImportError:
        print("transformers: skipped (not installed; pip install transformers)")
        return None
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    inp = torch.tensor([ids])

    def make(n: int) -> Callable[[], object]:
        def go() -> None:
            with torch.no_grad():
                # eos_token_id=None: decode exactly n tokens whatever the random model emits.
                model.generate(
                    inp,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )

        return go

    return decode_rate(make, args.tokens, args.repeats, bar)


# --- the command -------------------------------------------------------------------------------


def _load_config(model: str) -> dict:
    from hetserve.errors import InvalidInputError, ModelNotFoundError

    if str(model).endswith(".gguf") and Path(model).is_file():  # the file's own metadata
        from hetserve.model.gguf_file import GgufCheckpoint

        cfg = GgufCheckpoint(Path(model)).hf_config()
        if not cfg.get("num_experts_per_tok"):
            raise InvalidInputError(f"{model!r} is not a MoE model (no expert_used_count)")
        return cfg
    path = Path(model) / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"no config.json in {model!r}: pass an HF model directory")
    cfg = json.loads(path.read_text())
    if not cfg.get("num_experts_per_tok"):
        raise InvalidInputError(f"{model!r} is not a MoE checkpoint (no num_experts_per_tok)")
    return cfg


def _gguf_rate(args, ids: list[int], threads: int, bar) -> float | None:
    """hetserve on the GGUF that llama.cpp times, with the preset's placement (CPU-only:
    all-int8): experts and linears on the native kernels of each tensor's own GGUF type."""
    import torch

    from hetserve.bench import decode_llamacpp as llamacpp

    path = llamacpp.gguf_path(args, threads)
    if path is None:
        return None
    # the presets read the GGUF's experts with their own format's backend
    placement = "hybrid" if torch.cuda.is_available() else "all-int8"
    return _hetserve_rate(args, ids, bar, placement, model=path)


def _kv_dtypes(value: str) -> list[str]:
    from hetserve.config import KV_CACHE_DTYPES
    from hetserve.errors import InvalidInputError

    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in KV_CACHE_DTYPES]
    if bad or not names:
        raise InvalidInputError(
            f"--kv-cache-dtypes: {bad or value!r} not among {', '.join(KV_CACHE_DTYPES)}"
        )
    return names


def _isolated(fn: Callable[[], float | None]) -> float | None:
    rate = fn()
    gc.collect()  # the system's weights go before the next one loads (RAM holds one copy)
    return rate


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from hetserve.bench import decode_llamacpp as llamacpp
    from hetserve.errors import InvalidInputError

    cfg = _load_config(args.model)
    if str(args.model).endswith(".gguf"):  # a file alone: llama.cpp and hetserve on it
        args.gguf = args.model
        args.skip_cpu_int8 = args.skip_all_int8 = args.skip_reference = args.skip_hf = True
    if args.tokens < 2:
        raise InvalidInputError("--tokens must be at least 2")
    if args.rounds < 1 or args.repeats < 1:
        raise InvalidInputError("--rounds and --repeats must be at least 1")
    require_at_least(args, 1, "prompt_len", "threads", "bandwidth_mib")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.streams is not None:  # '' too: parse_streams says what it wants
        from hetserve.bench import decode_streams

        return decode_streams.run(args, cfg)
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (args.prompt_len,), generator=g).tolist()
    bandwidth = measure_bandwidth(args.bandwidth_mib)

    kv_dtypes = _kv_dtypes(args.kv_cache_dtypes)
    logprobs: dict[str, list[float]] = {}  # the prompt's, per KV dtype (all-int8 rows)
    plan: list[tuple[str, Callable[[], float | None]]] = []
    numas = {"off": ["off"], "auto": ["auto"], "both": ["off", "auto"]}[args.numa]
    for numa in numas:
        tag = "" if numa == "off" else " numa=auto"
        tag += " w8a8" if args.activation_bits == 8 else ""
        if not args.skip_cpu_int8:
            hybrid = lambda n=numa: _hetserve_rate(args, ids, bar, "hybrid", numa=n)  # noqa: E731
            plan.append(("hetserve cpu-int8" + tag, hybrid))
        if args.skip_all_int8 or torch.cuda.is_available():
            continue
        # CPU-only: the non-expert linears are on the CPU too, so make them int8 as well.
        for kv in kv_dtypes:
            name = "hetserve all-int8" + ("" if kv == "auto" else f" kv={kv}") + tag
            plan.append(
                (
                    name,
                    lambda kv=kv, n=numa: _hetserve_rate(
                        args, ids, bar, "all-int8", None, kv, logprobs, numa=n
                    ),
                )
            )
    if not args.skip_reference:
        plan.append(("hetserve fp32", lambda: _hetserve_rate(args, ids, bar, "device")))
    if not args.skip_hf:
        plan.append(("transformers fp32", lambda: _hf_rate(args, ids, bar)))
    peer = f"llama.cpp {args.gguf_type if args.gguf is None else 'gguf'}"
    if not args.skip_llamacpp:
        plan.append((peer, lambda: llamacpp.rate(args, ids, threads, bar)))
    if not args.skip_gguf_hetserve and (args.gguf or not args.skip_llamacpp):
        name = f"hetserve {'gguf' if args.gguf else args.gguf_type} (same GGUF)"
        plan.append((name, lambda: _gguf_rate(args, ids, threads, bar)))
    runs: dict[str, list[float | None]] = {name: [] for name, _ in plan}
    total = 2 * args.repeats * len(plan) * args.rounds
    with tqdm(total=total, desc="bench decode", unit="run") as bar:
        for r in range(args.rounds):
            for name, fn in plan if r % 2 == 0 else plan[::-1]:
                bar.set_postfix_str(f"{name} (round {r + 1})")
                runs[name].append(_isolated(fn))
    rates = {name: max((x for x in rs if x), default=None) for name, rs in runs.items()}
    # Probed again once every model is freed: the best of both is the least disturbed reading.
    bandwidth = max(bandwidth, measure_bandwidth(args.bandwidth_mib))
    report = build_report(args, cfg, rates, bandwidth, threads, peer)
    report["rounds_tokens_per_s"] = runs
    report["kv_logprob_error_vs_float32"] = kv_logprob_errors(logprobs)
    report["numa_auto_vs_off"] = {
        name: rates[name + " numa=auto"] / r
        for name, r in rates.items()
        if r and rates.get(name + " numa=auto")
    }
    print_report(report)
    write_json(args.json, report)
    return 0
