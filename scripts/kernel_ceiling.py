"""Compute ceiling vs memory of each native experts backend at one token.

The same MoE layer call (6 experts, hidden 2048, inter 256 by default) timed twice: "hot", with
its weights cache-resident (the same experts called back to back: what the kernel's arithmetic
allows), and "cold", right after a 256 MiB read-bandwidth probe has flushed the caches (what
`hetserve bench moe-kernel` measures). A backend whose hot rate is below 0.8 x the probe's
bandwidth cannot reach 0.8 of it cold, whatever the memory system does.

    .venv/bin/python scripts/kernel_ceiling.py [--inter 256] [--backends cpu-int8,cpu-mxfp4,...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hetserve.bench.moe_kernel import ReadBandwidthProbe, _make_backend
from hetserve.moe.experts import ExpertWeights

BACKENDS = "cpu-fp32,cpu-int8,cpu-int8:q8_0,cpu-int4,cpu-int4:q4_K,cpu-mxfp4,cpu-fp8"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inter", type=int, default=256)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--backends", default=BACKENDS)
    args = p.parse_args()
    e, i, h, k = args.top_k, args.inter, args.hidden, args.top_k
    g = torch.Generator().manual_seed(0)
    w = ExpertWeights(
        torch.randn(e, 2 * i, h, generator=g) * 0.02, torch.randn(e, h, i, generator=g) * 0.02
    )
    probe = ReadBandwidthProbe(256)
    x, tw, ids = torch.randn(1, h), torch.rand(1, k), torch.arange(k).unsqueeze(0)
    weights = k * 3 * i * h
    heads = ("B/weight", "hot Gw/s", "hot GB/s", "cold GB/s", "probe GB/s", "cold/probe")
    print(f"{'backend':14s} " + " ".join(f"{c:>10s}" for c in (*heads, "hot/probe")))
    for name in args.backends.split(","):
        b = _make_backend(name, w, 64)
        nbytes = b.nbytes() / e * k
        for _ in range(3):
            b.forward(x, tw, ids)
        hot = []
        for _ in range(30):
            t = time.perf_counter()
            b.forward(x, tw, ids)
            hot.append(time.perf_counter() - t)
        cold, probes = [], []
        for _ in range(10):
            probes.append(probe())
            t = time.perf_counter()
            b.forward(x, tw, ids)
            cold.append(time.perf_counter() - t)
        th, tc, pr = min(hot), statistics.median(cold), statistics.median(probes)
        row = (nbytes / weights, weights / th / 1e9, nbytes / th / 1e9, nbytes / tc / 1e9, pr,
               nbytes / tc / 1e9 / pr, nbytes / th / 1e9 / pr)  # fmt: skip
        print(f"{name:14s} " + " ".join(f"{v:10.2f}" for v in row))
        del b


if __name__ == "__main__":
    main()
