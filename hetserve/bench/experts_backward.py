"""`hetserve bench experts-backward`: one routed-experts layer's backward, as `hetserve finetune`
runs it, against torch's reference backward and the CPU's fp32 GEMM peak.

The layer (default: the small MoE's, 512 tokens, top-4 of 32 experts, hidden 256, inter 128) is
timed three ways on torch's threads, best of --repeats x --calls calls each: the experts
backend's forward (cpu-fp32, or cpu-int8 / cpu-int4 with --bits), the native backward
(`experts_backward`: input and router-weight gradients, gate/up recomputed) and torch's
reference backward (`torch_backward`: autograd through the per-expert loop, what runs where the
kernel does not apply). GFLOP/s count the forward's three products per (token, expert) pair and
the backward's five (gate/up again, W2^T, W13^T); `of peak` divides them by the best fp32
matrix-multiply rate of this CPU, measured in the same run.

Kept apart from `bench finetune`, which times whole training steps against transformers + PEFT:
this is the one kernel, where the experts' share of a step is decided.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from hetserve.bench.common import print_table, write_json

FORWARD_BACKEND = {32: "cpu-fp32", 8: "cpu-int8", 4: "cpu-int4"}
INT4_GROUP = 64  # --bits 4: the forward's and the backward's weights quantized alike


def register(sub) -> None:
    p = sub.add_parser(
        "experts-backward", help="routed experts' native backward vs torch's and the GEMM peak"
    )
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=128, help="moe_intermediate_size")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--bits", type=int, choices=(32, 8, 4), default=32, help="experts' weights")
    p.add_argument("--calls", type=int, default=20, help="calls per timed round")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (best kept)")
    p.add_argument("--json", "--result-file", dest="json", default=None, help="write JSON here")
    p.set_defaults(func=run)


def best_ms(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Best mean time of `calls` back-to-back calls over `repeats` rounds, after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e3


def _check(args: argparse.Namespace) -> None:
    from hetserve.errors import InvalidInputError

    for flag in ("experts", "hidden", "inter", "tokens", "top_k", "calls", "repeats"):
        if getattr(args, flag) < 1:
            raise InvalidInputError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.top_k > args.experts:
        raise InvalidInputError(f"--top-k {args.top_k} is more than --experts {args.experts}")
    if args.bits == 4 and (args.hidden % INT4_GROUP or args.inter % INT4_GROUP):
        raise InvalidInputError(
            f"--bits 4 quantizes in groups of {INT4_GROUP}: --hidden {args.hidden} and --inter "
            f"{args.inter} must be multiples of it"
        )


def _layer(e: int, h: int, inter: int, t: int, k: int) -> tuple:
    """Random weights (unit-variance outputs), inputs, output gradients and routing."""
    import torch

    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter**0.5
    x, gout = torch.randn(t, h, generator=g), torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return w13, w2, x, gout, ids, torch.rand(t, k, generator=g)


def run(args: argparse.Namespace) -> int:
    import torch

    from hetserve.bench.finetune import gemm_peak_gflops
    from hetserve.finetune.experts_grad import (
        experts_backward,
        make_grad_weights,
        native_backward_applies,
        torch_backward,
    )
    from hetserve.moe.experts import ExpertWeights, create_backend

    _check(args)
    e, h, inter, t, k = args.experts, args.hidden, args.inter, args.tokens, args.top_k
    w13, w2, x, gout, ids, tw = _layer(e, h, inter, t, k)
    gw = make_grad_weights(w13, w2, bits=args.bits, group_size=INT4_GROUP)
    opts = {"group_size": INT4_GROUP} if args.bits == 4 else {}
    fwd = create_backend(FORWARD_BACKEND[args.bits], ExpertWeights(w13, w2), **opts)
    calls, repeats = args.calls, args.repeats
    ms = {
        "forward": best_ms(lambda: fwd.forward(x, tw, ids), calls, repeats),
        "backward": best_ms(lambda: experts_backward(gw, x, tw, ids, gout), calls, repeats),
        "torch backward": best_ms(lambda: torch_backward(gw, x, tw, ids, gout), calls, repeats),
    }
    peak = gemm_peak_gflops()
    products = t * k * 3 * h * inter * 2  # FLOPs of the forward's three products
    flops = {"forward": products, "backward": products * 5 / 3, "torch backward": products * 5 / 3}
    rows = {
        name: {"ms": ms[name], "gflops": flops[name] / ms[name] / 1e6,
               "of_gemm_peak": flops[name] / ms[name] / 1e6 / peak}
        for name in ms
    }  # fmt: skip
    print_table(
        ["call", "ms", "GFLOP/s", "of GEMM peak", "vs torch backward"],
        [[name, r["ms"], r["gflops"], r["of_gemm_peak"], ms["torch backward"] / r["ms"]]
         for name, r in rows.items()],
    )  # fmt: skip
    speedup = ms["torch backward"] / ms["backward"]
    kernel = "native" if native_backward_applies(gw, x) else "torch (the native kernel declined)"
    print(f"backward kernel: {kernel}; fp32 GEMM peak of this CPU {peak:.0f} GFLOP/s; backward "
          f"{speedup:.2f}x torch's")  # fmt: skip
    write_json(
        args.json,
        {
            "benchmark": "experts-backward",
            "shape": {"experts": e, "hidden": h, "inter": inter, "tokens": t, "top_k": k},
            "bits": args.bits,
            "calls": calls,
            "repeats": repeats,
            "threads": torch.get_num_threads(),
            "backward_kernel": kernel.split()[0],
            "gemm_peak_gflops": peak,
            "results": {name.replace(" ", "_"): r for name, r in rows.items()},
            "backward_speedup_vs_torch": speedup,
            "backward_over_forward": ms["backward"] / ms["forward"],
        },
    )
    return 0
