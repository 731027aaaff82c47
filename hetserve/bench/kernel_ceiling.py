"""`hetserve bench kernel-ceiling`: compute ceiling vs memory of each CPU experts backend.

The same MoE layer call (top-k experts of hidden x inter, one token) timed twice: "hot", with its
weights cache-resident (the same experts called back to back: what the kernel's arithmetic
allows), and "cold", right after a read-bandwidth probe has flushed the caches (what
`hetserve bench moe-kernel` measures). Both are divided by the probe's bandwidth, measured in the
same run: a backend whose hot rate is below 0.8 x the probe cannot reach 0.8 of it cold,
whatever the memory system does.

Kept apart from `bench moe-kernel` rather than a flag of it: a different layer (only the
experts a token uses, all resident), different timings and different columns.
"""

from __future__ import annotations

import argparse
import statistics
import time

from hetserve.bench.common import print_table, write_json

BACKENDS = "cpu-fp32,cpu-int8,cpu-int8:q8_0,cpu-int4,cpu-int4:q4_K,cpu-mxfp4,cpu-fp8"


def register(sub) -> None:
    p = sub.add_parser(
        "kernel-ceiling", help="cache-resident (hot) vs cold rate of each CPU experts backend"
    )
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=256, help="moe_intermediate_size")
    p.add_argument("--top-k", type=int, default=6, help="experts per token (all of the layer's)")
    p.add_argument(
        "--backends",
        default=BACKENDS,
        help="NAME, NAME:KERNEL or NAME:FORMAT as `bench moe-kernel` takes them, comma-separated",
    )
    p.add_argument("--hot-iters", type=int, default=30, help="back-to-back calls (best kept)")
    p.add_argument("--cold-iters", type=int, default=10, help="calls after a probe (median)")
    p.add_argument("--int4-group-size", type=int, default=64)
    p.add_argument("--bandwidth-mib", type=int, default=256, help="bandwidth probe buffer size")
    p.add_argument("--json", "--result-file", dest="json", default=None, help="write JSON here")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace, backends: list[str]) -> None:
    from hetserve.bench.moe_kernel import check_backends
    from hetserve.errors import InvalidInputError

    for flag in ("hidden", "inter", "top_k", "hot_iters", "cold_iters", "bandwidth_mib"):
        if getattr(args, flag) < 1:
            raise InvalidInputError(f"--{flag.replace('_', '-')} must be >= 1")
    if not backends:
        raise InvalidInputError("--backends names no backend")
    check_backends(backends, args.hidden, args.inter)


def _measure(backend, probe, k: int, hidden: int, hot_iters: int, cold_iters: int) -> dict:
    import torch

    x, tw, ids = torch.randn(1, hidden), torch.rand(1, k), torch.arange(k).unsqueeze(0)
    for _ in range(3):
        backend.forward(x, tw, ids)
    hot = []
    for _ in range(hot_iters):
        t = time.perf_counter()
        backend.forward(x, tw, ids)
        hot.append(time.perf_counter() - t)
    cold, probes = [], []
    for _ in range(cold_iters):
        probes.append(probe())
        t = time.perf_counter()
        backend.forward(x, tw, ids)
        cold.append(time.perf_counter() - t)
    return {
        "hot_s": min(hot),
        "cold_s": statistics.median(cold),
        "probe": statistics.median(probes),
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from hetserve.bench.moe_kernel import ReadBandwidthProbe, make_backend
    from hetserve.moe.experts import ExpertWeights

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    _check(args, backends)
    k, i, h = args.top_k, args.inter, args.hidden
    g = torch.Generator().manual_seed(0)
    # The layer holds exactly the experts the token picks: every call reads all of them.
    w = ExpertWeights(
        torch.randn(k, 2 * i, h, generator=g) * 0.02, torch.randn(k, h, i, generator=g) * 0.02
    )
    probe = ReadBandwidthProbe(args.bandwidth_mib)
    weights = k * 3 * i * h
    results = []
    for name in backends:
        b = make_backend(name, w, args.int4_group_size)
        nbytes = b.nbytes()
        m = _measure(b, probe, k, h, args.hot_iters, args.cold_iters)
        hot_gbps, cold_gbps = nbytes / m["hot_s"] / 1e9, nbytes / m["cold_s"] / 1e9
        results.append({
            "backend": name, "bytes_per_weight": nbytes / weights, "hot_us": m["hot_s"] * 1e6,
            "cold_us": m["cold_s"] * 1e6, "hot_gweights_per_s": weights / m["hot_s"] / 1e9,
            "hot_gbps": hot_gbps, "cold_gbps": cold_gbps, "probe_gbps": m["probe"],
            "cold_over_probe": cold_gbps / m["probe"], "hot_over_probe": hot_gbps / m["probe"],
        })  # fmt: skip
        del b
    keys = ("backend", "bytes_per_weight", "hot_gweights_per_s", "hot_gbps", "cold_gbps",
            "probe_gbps", "cold_over_probe", "hot_over_probe")  # fmt: skip
    print_table(
        ["backend", "B/weight", "hot Gw/s", "hot GB/s", "cold GB/s", "probe GB/s", "cold/probe",
         "hot/probe"],
        [[r[key] for key in keys] for r in results],
    )  # fmt: skip
    write_json(
        args.json,
        {
            "benchmark": "kernel-ceiling",
            "shape": {"hidden": h, "inter": i, "top_k": k},
            "int4_group_size": args.int4_group_size,
            "threads": torch.get_num_threads(),
            "bandwidth_gbps": probe.summary(),
            "results": results,
        },
    )
    return 0
