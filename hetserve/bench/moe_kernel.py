"""`hetserve bench moe-kernel`: one MoE layer on each CPU experts backend versus memory bandwidth.

For each backend and token count it times `forward` on random routings (each token picks top-k
distinct experts uniformly, a fresh routing every call so the caches hold nothing useful) and
reports the weight bytes of the experts actually touched per second. Next to it: this machine's
memory read bandwidth measured in the same run, as `torch.sum` over a buffer much larger than
the last-level cache with the same intra-op threads: a pure sequential read stream, which is what
streaming expert weights is. One probe runs right before every timed call (alternating plain and
huge-page memory), so both see the same background load. Ratios are best-vs-best (the rates the
machine reaches when least disturbed) and median-vs-median; shared machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

# NAME or NAME:KERNEL (kernel option of cpu-int8/cpu-int4: native | library). cpu-mxfp4 and
# cpu-fp8 quantize the random weights to those formats (MXFP4 blocks of 32, FP8 128 x 128).
DEFAULT_BACKENDS = "cpu-fp32,cpu-int8,cpu-int8:library,cpu-int4,cpu-int4:library,cpu-mxfp4,cpu-fp8"


def register(sub) -> None:
    p = sub.add_parser("moe-kernel", help="one MoE layer per CPU experts backend vs bandwidth")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=1408, help="moe_intermediate_size")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--tokens", default="1,4,16", help="comma-separated token counts")
    p.add_argument(
        "--backends", default=DEFAULT_BACKENDS, help="NAME or NAME:KERNEL, comma-separated"
    )
    p.add_argument("--iters", type=int, default=10, help="timed calls per (backend, tokens)")
    p.add_argument(
        "--int4-group-size", type=int, default=64, help="cpu-int4 group (32: GGUF q4_K's)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--bandwidth-mib", type=int, default=256, help="bandwidth probe buffer size")
    p.add_argument("--json", "--result-file", dest="json", default=None, help="write JSON here")
    p.set_defaults(func=run)


def _int_list(text: str) -> list[int]:
    from hetserve.errors import InvalidInputError

    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InvalidInputError(
            f"--tokens must be comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise InvalidInputError(f"--tokens needs positive integers, got {text!r}")
    return values


class ReadBandwidthProbe:
    """GB/s of `torch.sum` over `mib` MiB of fp32 (each pass reads it once), on plain and on
    huge-page memory (as the native kernels' weights are) in turn. The bench probes right before
    every timed call, so probes and kernels see the same background load; the limit reported is
    the best rate any probe showed."""

    def __init__(self, mib: int) -> None:
        import torch

        from hetserve.native import hugepage_empty

        n = mib * 1024 * 1024 // 4
        self.bufs = [torch.ones(n), hugepage_empty((n,), torch.float32).fill_(1.0)]
        for buf in self.bufs:
            buf.sum()  # fault in and warm the pool
        self.rates: list[float] = []

    def __call__(self) -> float:
        buf = self.bufs[len(self.rates) % 2]
        t0 = time.perf_counter()
        buf.sum()
        rate = buf.nbytes / (time.perf_counter() - t0) / 1e9
        self.rates.append(rate)
        return rate

    def summary(self) -> dict[str, float]:
        return {
            "best": max(self.rates),
            "median": statistics.median(self.rates),
            "probes": len(self.rates),
        }


def _time_backend(backend, probe, hidden: int, experts: int, top_k: int, tokens: int, iters: int):
    import torch

    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g)
    tw = torch.rand(tokens, top_k, generator=g)
    routings = [
        torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
        for _ in range(iters + 2)
    ]
    per_expert = backend.nbytes() / experts
    for ids in routings[:2]:
        backend.forward(x, tw, ids)
    times, rates, touched = [], [], []
    for ids in routings[2:]:
        n = int(ids.unique().numel())
        probe()
        t0 = time.perf_counter()
        backend.forward(x, tw, ids)
        dt = time.perf_counter() - t0
        times.append(dt)
        rates.append(n * per_expert / dt / 1e9)
        touched.append(n)
    return {
        "median_us": statistics.median(times) * 1e6,
        "best_us": min(times) * 1e6,
        "experts_touched": statistics.mean(touched),
        "gbps_median": statistics.median(rates),
        "gbps_best": max(rates),
    }


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from hetserve.errors import InvalidInputError
    from hetserve.moe.experts import ExpertWeights, available_backends, create_backend

    tokens = _int_list(args.tokens)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b.split(":")[0] not in available_backends()]
    if unknown:
        raise InvalidInputError(
            f"unknown experts backend(s) {unknown}; available: {', '.join(available_backends())}"
        )
    if args.top_k > args.experts or min(args.hidden, args.inter, args.experts, args.top_k) < 1:
        raise InvalidInputError("need 1 <= top-k <= experts and positive sizes")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    g = torch.Generator().manual_seed(0)
    e, i, h = args.experts, args.inter, args.hidden
    weights = ExpertWeights(
        torch.randn(e, 2 * i, h, generator=g) * 0.02, torch.randn(e, h, i, generator=g) * 0.02
    )
    probe = ReadBandwidthProbe(args.bandwidth_mib)
    results = []
    with tqdm(total=len(backends) * len(tokens), desc="moe-kernel", unit="case") as bar:
        for name in backends:
            bar.set_postfix_str(f"building {name}")
            base, _, kernel = name.partition(":")
            opts = {"kernel": kernel} if kernel else {}
            if base == "cpu-int4":
                opts["group_size"] = args.int4_group_size
            backend = create_backend(base, weights, **opts)
            for t in tokens:
                bar.set_postfix_str(f"{name} T={t}")
                r = _time_backend(backend, probe, h, e, args.top_k, t, args.iters)
                results.append({"backend": name, "impl": type(backend).__name__, "tokens": t, **r})
                bar.update(1)
            del backend
    bandwidth = probe.summary()
    for r in results:
        r["ratio_best"] = r["gbps_best"] / bandwidth["best"]
        r["ratio_median"] = r["gbps_median"] / bandwidth["median"]
    _print_table(results, bandwidth, threads)
    if args.json:
        out = {
            "bench": "moe-kernel",
            "shape": {"hidden": h, "inter": i, "experts": e, "top_k": args.top_k},
            "int4_group_size": args.int4_group_size,
            "threads": threads,
            "torch": torch.__version__,
            "bandwidth_gbps": bandwidth,
            "bandwidth_measure": (
                f"torch.sum over {args.bandwidth_mib} MiB fp32 (plain and huge pages), probed "
                "before every timed call; best/median over all probes"
            ),
            "results": results,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _print_table(results: list[dict], bandwidth: dict, threads: int) -> None:
    print(
        f"memory read bandwidth ({threads} threads): best {bandwidth['best']:.1f} GB/s, "
        f"median {bandwidth['median']:.1f} GB/s over {bandwidth['probes']} probes"
    )
    header = (
        "backend",
        "tokens",
        "experts",
        "median us",
        "best us",
        "GB/s med",
        "GB/s best",
        "ratio best",
        "ratio med",
    )
    rows = [
        (
            r["backend"],
            str(r["tokens"]),
            f"{r['experts_touched']:.1f}",
            f"{r['median_us']:.0f}",
            f"{r['best_us']:.0f}",
            f"{r['gbps_median']:.1f}",
            f"{r['gbps_best']:.1f}",
            f"{r['ratio_best']:.2f}",
            f"{r['ratio_median']:.2f}",
        )
        for r in results
    ]
    widths = [max(len(row[k]) for row in (header, *rows)) for k in range(len(header))]
    for row in (header, *rows):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
