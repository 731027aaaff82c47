"""`hetserve bench moe-kernel`: one MoE layer on each CPU experts backend versus memory bandwidth.

For each backend and token count it times `forward` on random routings (each token picks top-k
distinct experts uniformly, a fresh routing every call so the caches hold nothing useful) and
reports the weight bytes of the experts actually touched per second. Next to it: this machine's
memory read bandwidth, as `torch.sum` over a buffer much larger than the last-level cache with
the same intra-op threads: a pure sequential read stream, which is what streaming expert weights
is (a hand-written AVX2 read loop reaches the same rate here).

The two are measured alike: one probe runs right before every timed call (alternating plain and
huge-page memory), so each call has its own reading of the bandwidth at that moment, and a row
compares its calls with its own probes only (as many samples each, the same minutes). On a
shared machine the bandwidth itself moves (here from ~25 to ~60 GB/s within minutes, with other
virtual machines on the host), so a probe taken at another time says little about a call.
Ratios per row: `ratio med` is the median over calls of (call's GB/s / its probe's GB/s),
`ratio best` is the best call's GB/s over the best of the row's probes. `other cpu` is the share
of the machine's CPU time that other processes took during the row's timed calls (from
/proc/stat): rows where it is high were disturbed.

Native backends also time each call inside C (entry to return, as the fused decode path calls
the kernel with no Python around it): `kernel` is the median of that rate over the call's
probe, where `ratio med` includes the Python of a `forward` call from cold caches (tens of
microseconds, a tenth of a one-token layer). And they read each call's bytes without the
arithmetic (`touch`: the same experts, work items and threads, after a probe of its own so it
finds nothing cached, timed in C alike): `touch` is that read's rate over its probe, the limit
of the layer's access pattern in those minutes, and `of touch` the median over calls of touch
time / kernel time, how much of that limit the kernel reaches. A kernel close to its touch is
bound by how its bytes arrive, not by its arithmetic.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

# NAME or NAME:KERNEL (kernel option of cpu-int8/cpu-int4: native | library; cpu-int8:a8 is the
# native kernel with int8 activations, W8A8), or NAME:FORMAT
# for experts packed in a GGUF type first (cpu-int4:q4_K, cpu-int8:q8_0), as a GGUF file's are.
# cpu-mxfp4 and cpu-fp8 quantize the random weights to those formats (MXFP4 blocks of 32, FP8
# 128 x 128).
DEFAULT_BACKENDS = "cpu-fp32,cpu-int8,cpu-int8:library,cpu-int4,cpu-int4:library,cpu-mxfp4,cpu-fp8"


def register(sub) -> None:
    p = sub.add_parser("moe-kernel", help="one MoE layer per CPU experts backend vs bandwidth")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=1408, help="moe_intermediate_size")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--tokens", default="1,4,16", help="comma-separated token counts")
    p.add_argument(
        "--backends",
        default=DEFAULT_BACKENDS,
        help="NAME, NAME:KERNEL or NAME:FORMAT (cpu-int8:a8 = W8A8, cpu-int4:q4_K, cpu-int8:q8_0, "
        "cpu-gguf:q6_K, "
        "cpu-gguf:q5_K, cpu-gguf:q3_K, cpu-gguf:q2_K, cpu-gguf:iq4_xs, cpu-gguf:iq4_nl, "
        "cpu-gguf:iq2_xxs ... iq1_m, cpu-gguf:q4_K+q6_K), comma-separated",
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


class OtherCpu:
    """Share of the machine's CPU time used by other processes between start() and stop():
    busy time from /proc/stat minus this process's own (Linux; None elsewhere)."""

    def __init__(self) -> None:
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._start: tuple[float, float, float] | None = None
        self.busy = 0.0
        self.wall = 0.0

    @staticmethod
    def _read() -> tuple[float, float] | None:
        try:
            cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
            own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        values = [int(v) for v in cpu]
        busy = sum(values) - values[3] - (values[4] if len(values) > 4 else 0)  # - idle, iowait
        return float(busy), float(int(own[11]) + int(own[12]))  # utime + stime

    def start(self) -> None:
        got = self._read()
        self._start = None if got is None else (*got, time.perf_counter())

    def stop(self) -> None:
        got = self._read()
        if got is None or self._start is None:
            return
        busy0, own0, t0 = self._start
        self.busy += max(0.0, (got[0] - busy0) - (got[1] - own0)) / self._tick
        self.wall += time.perf_counter() - t0

    def share(self) -> float | None:
        cpus = os.cpu_count() or 1
        return self.busy / (self.wall * cpus) if self.wall > 0 else None


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
    times, rates, probes, touched = [], [], [], []
    touch = getattr(backend, "touch", None)
    kernel_ratios, touch_ratios, of_touch = [], [], []
    other = OtherCpu()
    other.start()
    for ids in routings[2:]:
        n = int(ids.unique().numel())
        probes.append(probe())
        t0 = time.perf_counter()
        backend.forward(x, tw, ids)
        dt = time.perf_counter() - t0
        times.append(dt)
        rates.append(n * per_expert / dt / 1e9)
        touched.append(n)
        if touch is not None:  # native: the same call timed inside C, and its reads alone
            dt_kernel = backend.last_kernel_seconds()
            kernel_ratios.append(n * per_expert / dt_kernel / 1e9 / probes[-1])
            p = probe()
            _, dt_touch = touch(ids)
            touch_ratios.append(n * per_expert / dt_touch / 1e9 / p)
            of_touch.append(dt_touch / dt_kernel)
    other.stop()
    touch_stats = {
        "kernel_ratio_median": statistics.median(kernel_ratios) if kernel_ratios else None,
        "touch_ratio_median": statistics.median(touch_ratios) if touch_ratios else None,
        "of_touch_median": statistics.median(of_touch) if of_touch else None,
    }
    return {
        **touch_stats,
        "median_us": statistics.median(times) * 1e6,
        "best_us": min(times) * 1e6,
        "experts_touched": statistics.mean(touched),
        "gbps_median": statistics.median(rates),
        "gbps_best": max(rates),
        "probe_gbps_median": statistics.median(probes),
        "probe_gbps_best": max(probes),
        "ratio_best": max(rates) / max(probes),
        "ratio_median": statistics.median(r / p for r, p in zip(rates, probes, strict=True)),
        "other_cpu": other.share(),
    }


# NAME:FORMAT -> (backend, packer of one [N, K] fp32 matrix into that GGUF type)
def _gguf_packers() -> dict:
    import torch

    from hetserve.quant.gguf import Q2KRows, Q3KRows, Q5KRows, Q6KRows
    from hetserve.quant.gguf_grid import BY_GGML, grid_reader
    from hetserve.quant.gguf_iq import iq4_nl_rows, iq4_xs_rows
    from hetserve.quant.packed import Int8Rows, Q4KRows
    from hetserve.testing.ggml_quant import ggml_quantize
    from hetserve.testing.gguf_quants import (
        quantize_q2_k,
        quantize_q3_k,
        quantize_q5_k,
        quantize_q6_k,
        random_iq4,
        random_iq_grid,
    )
    from hetserve.testing.tiny_gguf import quantize_q4_k

    def blocks(cls, fn, size):
        return lambda w: cls(torch.from_numpy(fn(w.numpy()).reshape(w.shape[0], -1, size)))

    seeds, noted = iter(range(1 << 30)), []

    def iquant(kind: str):
        """llama.cpp's own quantizer (testing/ggml_quant.py) where llama-cpp-python is
        installed, else random valid blocks: the kernel reads the same bytes either way."""

        def quantize(w):
            try:
                return ggml_quantize(w.numpy(), kind)
            except RuntimeError as exc:
                if not noted:
                    print(f"{kind}: random valid blocks ({exc})")
                    noted.append(kind)
                make = random_iq4 if kind.startswith("IQ4") else random_iq_grid
                return make(kind, w.shape[0], w.shape[1], next(seeds))

        return quantize

    return {
        "q4_K": ("cpu-int4", blocks(Q4KRows, quantize_q4_k, 144)),
        "q8_0": ("cpu-int8", Int8Rows.q8_0),
        "q6_K": ("cpu-gguf", blocks(Q6KRows, quantize_q6_k, 210)),
        "q5_K": ("cpu-gguf", blocks(Q5KRows, quantize_q5_k, 176)),
        "q3_K": ("cpu-gguf", blocks(Q3KRows, quantize_q3_k, 110)),
        "q2_K": ("cpu-gguf", blocks(Q2KRows, quantize_q2_k, 84)),
        "iq4_xs": ("cpu-gguf", lambda w, q=iquant("IQ4_XS"): iq4_xs_rows(q(w))),
        "iq4_nl": ("cpu-gguf", lambda w, q=iquant("IQ4_NL"): iq4_nl_rows(q(w))),
        **{name.lower(): ("cpu-gguf", lambda w, q=iquant(name), r=grid_reader(name): r(q(w)))
           for name in BY_GGML},  # fmt: skip
    }


def check_backends(backends: list[str], hidden: int, inter: int) -> None:
    """InvalidInputError (exit 2) for a backend name this machine lacks, or a GGUF format the
    layer's sizes cannot hold."""
    from hetserve.errors import InvalidInputError
    from hetserve.moe.experts import available_backends

    unknown = [b for b in backends if b.split(":")[0] not in available_backends()]
    if unknown:
        raise InvalidInputError(
            f"unknown experts backend(s) {unknown}; available: {', '.join(available_backends())}"
        )
    if any(b.endswith("_K") for b in backends) and (hidden % 256 or inter % 256):
        raise InvalidInputError(
            f"K-quant rows are super-blocks of 256: --hidden {hidden} and --inter {inter} "
            "must be multiples of 256 (e.g. --inter 1536)"
        )


def make_backend(name: str, weights, int4_group: int):
    """The experts backend a --backends entry names (NAME, NAME:KERNEL or NAME:FORMAT)."""
    from hetserve.moe.experts import ExpertWeights, create_backend
    from hetserve.quant.packed import PackedExperts

    base, _, option = name.partition(":")
    packers = _gguf_packers()
    kinds = option.split("+")  # cpu-gguf:q4_K+q6_K: gate/up in one type, down in another
    if all(k in packers for k in kinds) and option:
        p13, p2 = packers[kinds[0]][1], packers[kinds[-1]][1]
        packed = PackedExperts(tuple(p13(w) for w in weights.w13), tuple(p2(w) for w in weights.w2))
        return create_backend(base, ExpertWeights(None, None, packed=packed))
    opts = {"kernel": option} if option else {}
    if base == "cpu-int8" and option == "a8":  # W8A8: int8 activations on the native kernel
        opts = {"activation_bits": 8}
    if base == "cpu-int4":
        opts["group_size"] = int4_group
    return create_backend(base, weights, **opts)


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from hetserve.bench.common import require_at_least, write_json
    from hetserve.errors import InvalidInputError
    from hetserve.moe.experts import ExpertWeights

    tokens = _int_list(args.tokens)
    require_at_least(args, 1, "iters", "threads", "bandwidth_mib", "int4_group_size")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends:
        raise InvalidInputError("--backends names no backend")
    check_backends(backends, args.hidden, args.inter)
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
            backend = make_backend(name, weights, args.int4_group_size)
            for t in tokens:
                bar.set_postfix_str(f"{name} T={t}")
                r = _time_backend(backend, probe, h, e, args.top_k, t, args.iters)
                results.append({"backend": name, "impl": type(backend).__name__, "tokens": t, **r})
                bar.update(1)
            del backend
    bandwidth = probe.summary()
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
                "right before every timed call; each row's ratios use its own calls' probes"
            ),
            "results": results,
        }
        write_json(args.json, out)  # with the machine's facts
    return 0


def _print_table(results: list[dict], bandwidth: dict, threads: int) -> None:
    from hetserve.bench.common import native_isa

    print(f"native kernels built for: {native_isa()}")
    print(
        f"memory read bandwidth ({threads} threads), all probes: best {bandwidth['best']:.1f} "
        f"GB/s, median {bandwidth['median']:.1f} GB/s over {bandwidth['probes']} probes; each "
        "row is compared with its own probes (probe columns)"
    )
    header = ("backend", "tokens", "experts", "median us", "best us", "GB/s med", "GB/s best",
              "probe med", "probe best", "ratio med", "ratio best", "kernel", "touch",
              "of touch", "other cpu")  # fmt: skip
    rows = [
        (
            r["backend"],
            str(r["tokens"]),
            f"{r['experts_touched']:.1f}",
            f"{r['median_us']:.0f}",
            f"{r['best_us']:.0f}",
            f"{r['gbps_median']:.1f}",
            f"{r['gbps_best']:.1f}",
            f"{r['probe_gbps_median']:.1f}",
            f"{r['probe_gbps_best']:.1f}",
            f"{r['ratio_median']:.2f}",
            f"{r['ratio_best']:.2f}",
            "-" if r.get("kernel_ratio_median") is None else f"{r['kernel_ratio_median']:.2f}",
            "-" if r.get("touch_ratio_median") is None else f"{r['touch_ratio_median']:.2f}",
            "-" if r.get("of_touch_median") is None else f"{r['of_touch_median']:.2f}",
            "-" if r["other_cpu"] is None else f"{100 * r['other_cpu']:.0f}%",
        )
        for r in results
    ]
    widths = [max(len(row[k]) for row in (header, *rows)) for k in range(len(header))]
    for row in (header, *rows):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
