"""One routed-experts layer of the small MoE (512 tokens, top-4 of 32, H 256, I 128), fp32:
the native forward and the native backward (input and router-weight gradients, gate/up
recomputed), best of 5 x 20 calls on torch's threads. GFLOP/s count the forward's three
products per pair, and the backward's five (gate/up again, W2^T, W13^T).

    .venv/bin/python scripts/experts_backward_bench.py
"""

from __future__ import annotations

import time

import torch

from hetserve.finetune.experts_grad import experts_backward, make_grad_weights
from hetserve.moe.experts import ExpertWeights, create_backend

E, H, INTER, T, K = 32, 256, 128, 512, 4


def best_ms(f, n: int = 20) -> float:
    f()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e3


def main() -> None:
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, INTER, generator=g) / INTER**0.5
    x, gout = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    tw = torch.rand(T, K, generator=g)
    gw = make_grad_weights(w13, w2)
    fwd = create_backend("cpu-fp32", ExpertWeights(w13, w2))
    tf = best_ms(lambda: fwd.forward(x, tw, ids))
    tb = best_ms(lambda: experts_backward(gw, x, tw, ids, gout))
    flops = T * K * 3 * H * INTER * 2
    print(f"forward {tf:.2f} ms ({flops / tf / 1e6:.0f} GFLOP/s)  "
          f"backward {tb:.2f} ms ({flops * 5 / 3 / tb / 1e6:.0f} GFLOP/s)")  # fmt: skip


if __name__ == "__main__":
    main()
