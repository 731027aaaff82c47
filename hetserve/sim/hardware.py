"""What one simulated instance is: its cost model (`InstanceProfile`, the policy's own type), the
KV it can hold, how fast it hands KV to a decode instance, and its price.

Presets are derived from published figures, cited in each preset's docstring; a number we
had to assume is marked "assumed" there (override it with a measured `hetserve profile` JSON,
`--hardware profile.json`). Prices are assumptions too (there are no list prices for most of
these machines): `--price NAME=USD` sets your own.

Who calls it: `hetserve sim` (`resolve`), tests. Failure contract: an unknown preset name or a
profile file that cannot be read is an `InvalidInputError` naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hetserve.disagg.costs import (
    DecodeFit,
    InstanceProfile,
    PrefillFit,
    fit_decode,
    fit_prefill,
    held_out,
    load_profile,
)
from hetserve.disagg.policy import POOL
from hetserve.errors import InvalidInputError
from hetserve.kv.tier_policy import TierCost

UNBOUNDED = 1 << 62  # tokens: a capacity a profile does not state


@dataclass(frozen=True)
class Hardware:
    name: str
    profile: InstanceProfile
    host_cache_tokens: int  # KV kept in the node's DRAM for reuse (the prefill side's cache)
    device_kv_tokens: int  # KV that fits beside the weights (what a decode batch may hold)
    handoff: TierCost  # pushing a request's KV from this prefill instance to a decode one
    price_per_hour: float  # USD; 0 = unknown (no goodput per dollar)
    # The tier the prefill side's cache is read from: host DRAM (Mooncake's nodes), or the
    # device pool itself where a measured instance has no host tier (its prefix cache).
    cache_tier: str = "dram"


@dataclass(frozen=True)
class CacheNode:
    """A CPU node that only lends DRAM to the global KV pool (Mooncake Store)."""

    name: str
    dram_bytes: int
    price_per_hour: float


# ---- LLaMA3-70B, the Mooncake paper's reproduction model --------------------------------------
# Mooncake FAST'25 (Qin et al.), Table 1: l = 80 layers, d = 8192, a = 4 and b = 22 in
# flops(n) = l (a n^2 d + b n d^2) (Eq. 1), gqa = 8, 2-byte elements.
L, D, A, B, GQA, ELEM = 80, 8192, 4, 22, 8, 2
KV_BYTES = L * 2 * (D // GQA) * ELEM  # 327,680 B = the paper's "320 KB" per token (Sec. 5.3.1)
PARAMS = 70.6e9  # LLaMA3-70B's parameter count (Meta's model card)
MFU = 0.5  # assumed: prefill and decode compute at half of the tensor cores' peak


def _llama70b(
    name: str,
    peak_flops: float,
    hbm_bw: float,
    hbm_bytes: float,
    h2d: float,
    nic: float,
    price: float,
) -> Hardware:
    """An 8-GPU LLaMA3-70B instance from its chips' figures. Eq. 1 of the paper is exactly the
    policy's prefill model: flops(n) - flops(p) = l b d^2 (n - p) + 2 l a d (n - p)(p + (n - p)/2),
    so c1 = l b d^2 / G and c2 = 2 l a d / G at G = 8 x peak x MFU. A decode step streams the
    weights once (d0), computes 2 x params FLOPs per sequence (d1) and reads each context
    token's KV once (d2), HBM at 70% of its peak (assumed). KV room on the GPUs: 90% of HBM
    (assumed: activations and workspace take the rest) less the BF16 weights."""
    g = 8 * peak_flops * MFU
    bw = 8 * hbm_bw * 0.7
    prefill = PrefillFit(c0=0.010, c1=L * B * D * D / g, c2=2 * L * A * D / g)  # c0 assumed
    decode = DecodeFit(d0=2 * PARAMS / bw, d1=2 * PARAMS / g, d2=KV_BYTES / bw)
    tiers = {"dram": TierCost(1e-4, h2d), POOL: TierCost(1e-3, min(nic, h2d))}  # latencies assumed
    profile = InstanceProfile(name, prefill, decode, KV_BYTES, tiers)
    device = int((0.9 * 8 * hbm_bytes - 2 * PARAMS) // KV_BYTES)
    return Hardware(name, profile, 3_000_000, device, TierCost(1e-3, nic), price)


def llama3_70b_a800() -> Hardware:
    """LLaMA3-70B on one node of 8 x A800-SXM4-80GB with 4 x 200 Gbps RDMA NICs, the Mooncake
    paper's testbed (FAST'25, Sec. 5.1).

    - Peak 312 TFLOPS BF16 per GPU and 128 GB/s host-to-device: the paper's Table 1.
    - HBM 2,039 GB/s and 80 GB per GPU: NVIDIA A100 80GB SXM datasheet (the A800 is the A100
      with a slower NVLink; same memory).
    - Pool reads and the P/D hand-off at 87 GB/s: the paper's transfer engine moving 40 GB over
      4 x 200 Gbps (Sec. 5.4.1), below the host-to-device 128 GB/s.
    - 3M tokens of DRAM cache per node: the paper's local cache (~1 TB of DRAM, Sec. 5.3.1).
    - Price: assumed $32/h (market rent of an 8 x A100-80GB node; A800s are not listed).
    """
    return _llama70b("llama3-70b-a800", 312e12, 2.039e12, 80e9, 128e9, 87e9, 32.0)


def llama3_70b_h800() -> Hardware:
    """LLaMA3-70B on 8 x H800-SXM5-80GB with 8 x 400 Gbps NICs: the prefill side of the
    Mooncake slides' heterogeneous pool ("H800 for prefill").

    - Peak 989 TFLOPS BF16 dense and 3.35 TB/s HBM per GPU: NVIDIA H100 SXM datasheet (the
      H800 differs in NVLink bandwidth only).
    - 190 GB/s pool reads and hand-off: the paper's transfer engine on 8 x 400 Gbps (Sec. 5.4.1).
    - 256 GB/s host-to-device: twice the A800 node's 128 GB/s (PCIe 5.0 doubles 4.0).
    - Price: assumed $45/h.
    """
    return _llama70b("llama3-70b-h800", 989e12, 3.35e12, 80e9, 256e9, 190e9, 45.0)


def llama3_70b_h20() -> Hardware:
    """LLaMA3-70B on 8 x H20-96GB: the decode side of the slides' pool ("H20 for decode"):
    little compute, much memory bandwidth.

    - Peak 148 TFLOPS BF16 dense, 4.0 TB/s HBM3 and 96 GB per GPU: NVIDIA's published H20
      figures.
    - NICs as the A800 node (4 x 200 Gbps, 87 GB/s: assumed) and PCIe 5.0 host link (256 GB/s).
    - Price: assumed $20/h.
    """
    return _llama70b("llama3-70b-h20", 148e12, 4.0e12, 96e9, 256e9, 87e9, 20.0)


# ---- DeepSeek-V3 on a KTransformers-style hybrid box ------------------------------------------
# KTransformers' DeepSeek-R1/V3 tutorial, V0.2.1, 8 experts, Q4_K_M, 2 x Xeon Gold 6454S with
# 8 x DDR5-4800 per socket, one RTX 4090: prompt tokens -> (prefill tok/s, decode tok/s), 300
# output tokens (10 for the 2-token prompt).
KT_PUBLISHED = {
    2: (12.2, 13.4),
    969: (88.2, 13.5),
    1930: (88.5, 13.4),
    3846: (81.9, 13.2),
    7678: (80.0, 12.4),
}
DSV3_KV_BYTES = 61 * (512 + 64) * 2  # 61 layers x MLA latent (512) + rope key (64), BF16


def deepseek_v3_ktransformers() -> Hardware:
    """DeepSeek-V3 (671B MoE) on one hybrid box, attention and shared experts on one RTX 4090,
    the 256 routed experts in CPU DRAM (KTransformers' design).

    - Prefill and decode fitted to KTransformers' published V0.2.1 figures (`KT_PUBLISHED`, their
      DeepSeek-R1/V3 tutorial): single-stream, so the decode step is all "per sequence" but a
      GPU part (d0 = 10 ms, assumed): a second sequence routes to mostly other experts (8 of
      256 per layer), so its expert reads from DRAM nearly double the step.
    - KV per token 70,272 B: 61 layers x (512 latent + 64 rope) x 2 B (DeepSeek-V3's config).
    - KV on the GPU: the 10 GB left beside the 14 GB the tutorial reports as needed.
    - Host cache: 256 GB of DRAM beside the weights (assumed); host-to-device 25 GB/s (PCIe
      4.0 x16 at ~80%); pool and hand-off over a 100 Gbps NIC at 10 GB/s (assumed).
    - Price: assumed $3/h (an amortized workstation, power included).
    """
    pre = [(n, 0, n / p) for n, (p, _) in KT_PUBLISHED.items()]
    dec = [(1, n + (5 if n < 10 else 150), 1 / d) for n, (_, d) in KT_PUBLISHED.items()]
    prefill, prefill_err = held_out(pre, fit_prefill, every=5)
    single = fit_decode(dec)
    decode = DecodeFit(d0=0.010, d1=max(single.d0 + single.d1 - 0.010, 0.0), d2=single.d2)
    tiers = {"dram": TierCost(1e-4, 25e9), POOL: TierCost(1e-3, 10e9)}
    profile = InstanceProfile(
        "deepseek-v3-ktransformers",
        prefill,
        decode,
        DSV3_KV_BYTES,
        tiers,
        prefill_fit_error=prefill_err,
    )
    host = int(256e9 // DSV3_KV_BYTES)
    device = int(10e9 // DSV3_KV_BYTES)
    return Hardware(profile.name, profile, host, device, TierCost(1e-3, 10e9), 3.0)


PRESETS: Mapping[str, Callable[[], Hardware]] = {
    "llama3-70b-a800": llama3_70b_a800,
    "llama3-70b-h800": llama3_70b_h800,
    "llama3-70b-h20": llama3_70b_h20,
    "deepseek-v3-ktransformers": deepseek_v3_ktransformers,
}

# A Xeon node lending 2 TB of DRAM to the pool ("Xeon for KVCache"): 16 x 128 GB DIMMs
# (assumed), price assumed $4/h.
CACHE_NODES: Mapping[str, CacheNode] = {"xeon-kvcache": CacheNode("xeon-kvcache", 2 << 40, 4.0)}


def resolve(spec: str) -> Hardware:
    """A preset by name, or a `hetserve profile` JSON file by path."""
    if spec in PRESETS:
        return PRESETS[spec]()
    if spec.endswith(".json") or Path(spec).is_file():
        return from_profile_file(spec)
    raise InvalidInputError(
        f"--hardware {spec!r}: not a preset ({', '.join(PRESETS)}) nor a profile .json file",
        param="--hardware",
    )


def from_profile_file(path: str) -> Hardware:
    """A measured machine: the profile's fits and tiers; its `capacity` section if it has one
    (else unbounded KV on the device and 3M tokens of host cache, overridable by flags); the
    hand-off at its pool tier's cost (none: same host). An instance measured without a host
    tier caches prefixes in its device pool only: the cache is that pool, read at no cost."""
    try:
        profile, raw = load_profile(path)
        cap = _capacity(raw.get("capacity") or {})
    except ValueError as exc:
        raise InvalidInputError(f"--hardware: {exc}", param="--hardware") from None
    handoff = profile.tiers.get(POOL) or TierCost(0.0, math.inf)
    device = cap.get("device_kv_tokens", UNBOUNDED)
    if "dram" in profile.tiers:
        cache, tier = cap.get("host_kv_tokens", 3_000_000), "dram"
    else:
        cache, tier = (device if device != UNBOUNDED else 3_000_000), "device"
    return Hardware(profile.name, profile, cache, device, handoff, 0.0, tier)


def _capacity(cap: Mapping[str, Any]) -> dict[str, int]:
    out = {}
    for key in ("device_kv_tokens", "host_kv_tokens"):
        if key in cap:
            x = cap[key]
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise ValueError(f"profile.capacity.{key}: expected an integer >= 0, got {x!r}")
            out[key] = x
    return out


def with_overrides(
    hw: Hardware, cache_tokens: int | None = None, price: float | None = None
) -> Hardware:
    """The same hardware with `--cache-tokens-per-instance` and `--price` applied."""
    if cache_tokens is not None:
        hw = replace(hw, host_cache_tokens=cache_tokens)
    if price is not None:
        hw = replace(hw, price_per_hour=price)
    return hw
