"""This machine's limits, measured: arithmetic peaks and read bandwidth, the yardsticks of
`bench prefill` (every row reads as a fraction of the limit that binds it).

Who calls it: `bench prefill` (before and after its systems run; the best of the two readings
is kept, the least disturbed on a shared machine), and anyone wanting the numbers
(`measure_peaks()`). Arithmetic comes from `hetserve/native/peaks.c` (independent
multiply-accumulate chains on every thread, the instructions hetserve's kernels use); bandwidth
from the read probe `bench moe-kernel` uses (`torch.sum` over a buffer far larger than the last
cache level). Where the native kernels cannot build, the arithmetic peaks are None with the
reason; a kind the CPU lacks (bf16 without AVX512-BF16) is None.
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass

# hetserve_peak's kinds (peaks.c), by what bench prefill calls them.
KINDS = {"fp32": 0, "int16": 1, "int8": 2, "bf16": 3}
# Each instruction the kinds time, for the table.
INSTRUCTIONS = {
    "fp32": "vfmadd231ps",
    "int16": "vpmaddwd + vpaddd",
    "int8": "vpdpbusd (AVX-512 VNNI), else vpmaddubsw + vpmaddwd + vpaddd",
    "bf16": "vdpbf16ps",
}


@dataclass
class Peaks:
    threads: int
    gops: dict[str, float | None]  # kind -> operations/s / 1e9 (a multiply-add is 2)
    read_gbps: float
    isa: str | None
    note: str | None = None  # why the arithmetic peaks are missing, if they are

    def best(self, other: Peaks) -> Peaks:
        """Per figure, the higher of two readings."""

        def hi(a: float | None, b: float | None) -> float | None:
            return max(a, b) if a is not None and b is not None else (a if b is None else b)

        gops = {k: hi(self.gops.get(k), other.gops.get(k)) for k in KINDS}
        return Peaks(self.threads, gops, max(self.read_gbps, other.read_gbps), self.isa, self.note)

    def to_dict(self) -> dict:
        return {**asdict(self), "instructions": INSTRUCTIONS}


def arithmetic_gops(kind: str, threads: int, seconds: float = 0.2) -> float | None:
    """Operations/s / 1e9 of `kind` on `threads` threads, best of 3 runs of ~`seconds`."""
    from hetserve.native import kernel, native_unavailable_reason

    if native_unavailable_reason() is not None:
        return None
    run, per_iter = kernel("hetserve_peak"), kernel("hetserve_peak_ops")(KINDS[kind])
    if per_iter < 0:
        return None
    iters = 1 << 16
    while run(KINDS[kind], threads, iters) < seconds / 8:  # calibrate on one thread's clock
        iters *= 2
    iters *= 8
    best = min(run(KINDS[kind], threads, iters) for _ in range(3))
    return per_iter * iters * threads / best / 1e9


def measure_peaks(threads: int, bandwidth_mib: int = 256, seconds: float = 0.2) -> Peaks:
    from hetserve.native import isa, native_unavailable_reason

    reason = native_unavailable_reason()
    gops = {k: arithmetic_gops(k, threads, seconds) for k in KINDS}
    return Peaks(threads, gops, measure_bandwidth(bandwidth_mib), None if reason else isa(), reason)


def measure_bandwidth(mib: int, probes: int = 8) -> float:
    """Best GB/s of `torch.sum` over `mib` MiB (the same probe as `bench moe-kernel`)."""
    from hetserve.bench.moe_kernel import ReadBandwidthProbe

    probe = ReadBandwidthProbe(mib)
    for _ in range(probes):
        probe()
    best = probe.summary()["best"]
    del probe
    gc.collect()
    return best
