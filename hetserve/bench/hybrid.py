"""`hetserve bench hybrid`: the hybrid split (routed experts on the CPU, the rest on the device)
in one run, against its own variants and an offload peer.

Rows, each timed in this process on the same checkpoint:
  * decode tok/s at each `--batch` (greedy, EOS ignored; (N - 1) / (t(N) - t(1)) per stream,
    times the batch), for: hybrid (CUDA graphs where the device is CUDA), hybrid eager
    (`--enforce-eager`), hybrid with expert deferral d for each `--defer`, and, with
    `--gpu-experts N --routing-stats FILE`, hybrid with the N hottest experts per layer on the
    device (a second load);
  * prefill tok/s at each `--prompt-lens` (one prompt, one output token, best of repeats);
  * the experts' fraction of the CPU's read bandwidth at batch 1: int8 expert bytes a token
    streams (top_k experts per MoE layer) times the tok/s, over `torch.sum`'s GB/s measured here;
  * the peer: transformers with accelerate's `device_map` CPU offload of the routed experts
    (decode tok/s at batch 1). It needs CUDA (offload moves CPU weights onto the GPU per
    forward); elsewhere its row is "-" with the reason.
On a CPU-only machine the device is the CPU, so every row measures the same code paths without
the accelerator; the figures that matter come from the GPU machine (scripts/gpu_suite.sh).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

from hetserve.bench.common import Unavailable, decode_rate, print_table, write_json
from hetserve.bench.hybrid_steps import _prompts, breakdowns, profile_table


def register(sub) -> None:
    p = sub.add_parser("hybrid", help="hybrid decode/prefill vs graphs, deferral, offload peer")
    p.add_argument("--model", required=True, help="HF MoE checkpoint directory")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the engine's choice)")
    p.add_argument("--batch", default="1,8", help="decode batch sizes, comma-separated")
    p.add_argument("--prompt-lens", default="1024", help="prefill prompt lengths ('' skips)")
    p.add_argument("--defer", default="1,2", help="deferral d values to time ('' skips)")
    p.add_argument("--gpu-experts", type=int, default=0, help="hot experts on the device")
    p.add_argument("--routing-stats", default=None, help="`hetserve calibrate` JSON (hot set)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per timed decode run")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt of the decode runs")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="CPU expert threads")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--skip-peer", action="store_true", help="skip the device_map offload peer")
    p.add_argument("--bandwidth-mib", type=int, default=256)
    p.add_argument("--profile", default=None, help="write torch.profiler tables of decode here")
    p.add_argument("--json", "--result-file", dest="json", default=None, help="write JSON here")
    p.set_defaults(func=run)


def _ints(text: str, flag: str) -> list[int]:
    from hetserve.errors import InvalidInputError

    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InvalidInputError(f"{flag} expects integers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise InvalidInputError(f"{flag} values must be >= 0")
    return values


def decode_tokens_per_s(llm, prompts: list[list[int]], tokens: int, repeats: int) -> float:
    """Aggregate decode tok/s of len(prompts) streams generating together."""
    from hetserve import SamplingParams

    def make(n: int) -> Callable[[], object]:
        params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True)
        return lambda: llm.generate(prompt_token_ids=prompts, sampling_params=params)

    return len(prompts) * decode_rate(make, tokens, repeats)


def prefill_tokens_per_s(llm, prompt: list[int], repeats: int) -> float:
    from hetserve import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up
        llm.reset_prefix_cache()  # each repeat computes the whole prompt
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=[prompt], sampling_params=params)
        best = min(best, time.perf_counter() - t0)
    return len(prompt) / best


def _decode_rows(llm, args, batches, vocab: int, label: str, defer: list[int]) -> list[dict]:
    rows = []
    runner = llm.engine.runner
    graphs = runner.graphs
    variants: list[tuple[str, int, bool]] = [(label, 0, True)]
    if graphs is not None:
        variants.append((f"{label} eager", 0, False))
    variants += [(f"{label} d={d}", d, True) for d in defer]
    for name, d, use_graphs in variants:
        applied = llm.model.set_expert_deferral(d)
        runner.graphs = graphs if use_graphs else None  # --enforce-eager without a reload
        for b in batches:
            prompts = _prompts(vocab, b, args.prompt_len)
            rate = decode_tokens_per_s(llm, prompts, args.tokens, args.repeats)
            rows.append({"system": name, "batch": b, "defer": applied, "tokens_per_s": rate})
    llm.model.set_expert_deferral(0)
    runner.graphs = graphs
    return rows


def _load(args, **extra):
    from hetserve import LLM

    options: dict = {"placement": "hybrid", **extra}
    for key in ("device", "max_model_len"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    if args.threads:
        options["cpu_threads"] = args.threads
    return LLM(args.model, **options)


def run(args: argparse.Namespace) -> int:
    import gc

    from hetserve.bench.decode import _load_config
    from hetserve.bench.peaks import measure_bandwidth
    from hetserve.errors import InvalidInputError

    cfg = _load_config(args.model)
    batches = _ints(args.batch, "--batch")
    lens, defer = _ints(args.prompt_lens, "--prompt-lens"), _ints(args.defer, "--defer")
    if not batches or 0 in batches or args.tokens < 2 or args.repeats < 1:
        raise InvalidInputError("--batch needs sizes >= 1, --tokens >= 2, --repeats >= 1")
    if args.gpu_experts and not args.routing_stats:
        raise InvalidInputError("--gpu-experts needs --routing-stats (from `hetserve calibrate`)")
    bandwidth = measure_bandwidth(args.bandwidth_mib)
    llm = _load(args)
    vocab = llm.model.config.vocab_size
    device = str(next(llm.model.parameters()).device)
    decode = _decode_rows(llm, args, batches, vocab, "hybrid", defer)
    threads = _process_threads()
    breakdown = breakdowns(llm, cfg, args, batches, vocab)
    if args.profile:
        profile_table(llm, args, batches, vocab, args.profile)
    prefill = [
        {"prompt_len": n, "tokens_per_s": prefill_tokens_per_s(llm, _prompts(vocab, 1, n)[0], 1)}
        for n in lens
    ]
    llm.close()
    del llm
    gc.collect()
    if args.gpu_experts:
        hot = _load(args, gpu_experts=args.gpu_experts, routing_stats=args.routing_stats)
        decode += _decode_rows(
            hot, args, batches, vocab, f"hybrid gpu-experts {args.gpu_experts}", []
        )
        hot.close()
        del hot
        gc.collect()
    peer = _peer(args, vocab) if not args.skip_peer else {"skipped": "--skip-peer"}
    report = build_report(args, cfg, device, bandwidth, decode, prefill, peer)
    report["decode_breakdown"] = breakdown
    # OS threads after the decode rows (OpenMP teams included) against the CPUs this process
    # may use: more threads than CPUs that compute at once is where libgomp's workers sleep
    # between parallel regions instead of spinning.
    report["process_threads_after_decode"] = threads
    report["usable_cpus"] = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    )
    report["decode_breakdown_batch1"] = breakdown[0] if breakdown[0]["batch"] == 1 else None
    print_report(report)
    write_json(args.json, report)
    return 0


def _process_threads() -> int | None:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux
        return None


def _peer(args, vocab: int) -> dict:
    try:
        rate = offload_peer_rate(args, _prompts(vocab, 1, args.prompt_len)[0])
    except Unavailable as exc:
        return {"tokens_per_s": None, "reason": str(exc)}
    return {"tokens_per_s": rate}


def offload_device_map(model_dir: str) -> dict[str, int | str]:
    """accelerate's `device_map` that keeps the routed experts on the CPU (moved onto the GPU
    per forward) and everything else on cuda:0: the offload peer of decode and of LoRA SFT."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    device_map: dict[str, int | str] = {"model.embed_tokens": 0, "model.norm": 0, "lm_head": 0}
    dense = getattr(cfg, "first_k_dense_replace", 0)
    for i in range(cfg.num_hidden_layers):
        device_map[f"model.layers.{i}"] = 0
        if i >= dense:  # DeepSeek's first layers have a dense MLP, no experts
            device_map[f"model.layers.{i}.mlp.experts"] = "cpu"
    return device_map


def offload_peer_rate(args, prompt: list[int]) -> float:
    """transformers + accelerate, routed experts offloaded to the CPU with `device_map`
    (everything else on cuda:0): single-stream decode tok/s."""
    import torch

    if not torch.cuda.is_available() or (args.device or "cuda").startswith("cpu"):
        raise Unavailable("needs CUDA: device_map offload streams CPU weights to the GPU")
    try:
        import accelerate  # noqa: F401  (device_map dispatch lives there)
        import transformers
    except ImportError as exc:
        raise Unavailable(f"{exc.name} not installed") from None
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16, device_map=offload_device_map(args.model)
    )
    model.eval()
    inp = torch.tensor([prompt], device="cuda:0")

    def make(n: int) -> Callable[[], object]:
        def go() -> None:
            with torch.no_grad():
                model.generate(inp, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               eos_token_id=None, pad_token_id=0)  # fmt: skip
            torch.cuda.synchronize()

        return go

    return decode_rate(make, args.tokens, args.repeats)


def build_report(args, cfg: dict, device, bandwidth, decode, prefill, peer) -> dict:
    from hetserve.bench.weight_bytes import expert_bytes_per_token

    experts = expert_bytes_per_token(cfg)
    base = {r["batch"]: r["tokens_per_s"] for r in decode if r["system"] == "hybrid"}
    # Deferral runs eagerly (its futures cannot be replayed from a graph), so its fair base is
    # the eager row where graphs exist; on CPU the two are the same row.
    eager = {r["batch"]: r["tokens_per_s"] for r in decode if r["system"] == "hybrid eager"}
    for r in decode:
        b = r["batch"]
        r["vs_hybrid"] = r["tokens_per_s"] / base[b] if base.get(b) else None
        ref_eager = eager.get(b, base.get(b))
        r["vs_eager"] = r["tokens_per_s"] / ref_eager if ref_eager else None
        ref = peer.get("tokens_per_s") if r["batch"] == 1 else None
        r["vs_offload_peer"] = r["tokens_per_s"] / ref if ref else None
    b1 = base.get(1)
    gbps = experts["bytes_per_token"] * b1 / 1e9 if b1 else None
    return {
        "benchmark": "hybrid",
        "model": str(args.model),
        "device": device,
        "threads": args.threads,
        "experts": experts,
        "read_bandwidth_gbps": bandwidth,
        "experts_gbps_batch1": gbps,
        "experts_bandwidth_fraction_batch1": gbps / bandwidth if gbps else None,
        "decode": decode,
        "prefill": prefill,
        "offload_peer": peer,
    }


def print_report(report: dict) -> None:
    print(f"device {report['device']}; CPU read bandwidth {report['read_bandwidth_gbps']:.1f} GB/s")
    if report.get("process_threads_after_decode"):
        print(f"threads in the process after decode: {report['process_threads_after_decode']} "
              f"on {report['usable_cpus']} CPUs")  # fmt: skip
    frac = report["experts_bandwidth_fraction_batch1"]
    print(f"experts at batch 1: {report['experts_gbps_batch1'] or 0:.2f} GB/s, "
          f"{frac or 0:.2f} of the read bandwidth")  # fmt: skip
    for br in report.get("decode_breakdown") or []:
        rate = f" ({br['kernels_gbps']:.1f} GB/s)" if br["kernels_gbps"] else ""
        print(f"batch-{br['batch']} decode step ({br['mode']}) {br['step_ms']:.2f} ms: routed "
              f"experts' host calls {br['experts_host_calls_ms']:.2f} ms, of it the CPU kernels "
              f"{br['experts_kernels_ms']:.2f} ms{rate}; "
              f"the rest {br['rest_ms']:.2f} ms")  # fmt: skip
    rows = [[r["system"], r["batch"], r["tokens_per_s"], r["vs_hybrid"], r["vs_eager"],
             r["vs_offload_peer"]] for r in report["decode"]]  # fmt: skip
    peer = report["offload_peer"]
    rows.append(["offload peer (device_map)", 1, peer.get("tokens_per_s"), None, None, None])
    print_table(["decode", "batch", "tok/s", "x hybrid", "x eager", "x offload peer"], rows)
    if peer.get("reason") or peer.get("skipped"):
        print(f"offload peer: - ({peer.get('reason') or peer.get('skipped')})")
    if report["prefill"]:
        print_table(
            ["prefill prompt", "tok/s"],
            [[r["prompt_len"], r["tokens_per_s"]] for r in report["prefill"]],
        )
