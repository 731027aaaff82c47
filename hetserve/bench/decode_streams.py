"""`hetserve bench decode --streams 1,4,16,32`: batched decode tokens/s of hetserve at several
numbers of concurrent streams, each against this machine's roofline measured in the same run.

Who calls it: `bench decode`'s `run` when `--streams` is given (instead of its single-stream
plan of systems). The engine (all-int8 on a CPU-only machine, hybrid beside an accelerator) is
loaded once; every stream count is timed in each of `--rounds` rounds, in reverse order every
other round, and keeps its best round (every round is in the JSON).

Rate at S streams: S (N - 1) / (t(S prompts x N tokens) - t(S prompts x 1 token)), best of
`--repeats`, so the prompts' prefill and start-up cancel out ("N tokens each, prefill excluded").

Each timed stream count of each round is also read against the bandwidth the machine showed
around it: `PAIRED` read probes right before its runs and as many right after (`bench
moe-kernel`'s probe), the best of them its own roofline. A shared host's bandwidth can swing
within a minute (the 2-core Zen 4 VM's two-thread probe read 53-59, 40-50, then 26-32 GB/s in
three calls twenty seconds apart, one thread 25-31 throughout), so the run's best probe, taken
before and after all the rounds, describes a moment the rounds may not have run in. Both
figures are reported: against the run's best probe, and the median over the rounds of each
round's fraction against its own probes.

Roofline of one decode step of S streams (`step_roofline`): the step reads each routed expert
that any of its tokens picks once (E (1 - (1 - k/E)^S) of a MoE layer's E experts, for routing
spread evenly: what a random checkpoint's router does) and every other linear once, all at int8;
and it computes 2 operations per multiply-add of S tokens through their top-k experts and the
other linears. It can go no faster than bytes over the measured read bandwidth, nor than
operations over the measured int8 / int16 multiply-add peaks (peaks.py, before and after the
runs, best kept); the slower of the two binds. Attention over the short contexts is left out
(a few percent of a step's arithmetic at these lengths) and so are norms and routing.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from collections.abc import Callable

from hetserve.bench.common import best_time, decode_run_fields, print_table, write_json

PAIRED = 4  # read probes before and after each timed stream count (plain and huge pages)


def parse_streams(text: str) -> list[int]:
    from hetserve.errors import InvalidInputError

    try:
        counts = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise InvalidInputError(f"--streams must be positive integers, comma-separated: {text!r}")
    return sorted(set(counts))


def _dims(cfg: dict) -> tuple[int, int, int, int]:
    """(experts, top_k, hidden, expert width)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg["n_routed_experts"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    return experts, cfg["num_experts_per_tok"], cfg["hidden_size"], inter


def step_roofline(cfg: dict, streams: int, read_gbps: float, gops: dict) -> dict:
    """Bytes and operations of one decode step of `streams` tokens and the tokens/s each
    limit allows (module docstring); `gops` maps the peaks' kinds to GOPS (None: unmeasured)."""
    from hetserve.bench.weight_bytes import (
        dense_bytes_per_token_fp32,
        expert_bytes_int8,
        moe_layer_count,
    )

    e, k, h, inter = _dims(cfg)
    layers = moe_layer_count(cfg)
    active = e * (1.0 - (1.0 - k / e) ** streams)  # expected experts picked per layer
    dense_params = (dense_bytes_per_token_fp32(cfg) or 0) // 4
    step_bytes = layers * active * expert_bytes_int8(h, inter) + dense_params
    step_ops = 2 * streams * (layers * k * 3 * h * inter + dense_params)
    bw_rate = streams / (step_bytes / (read_gbps * 1e9))
    compute = {kind: streams / (step_ops / (g * 1e9)) for kind, g in gops.items() if g}
    fastest = max(compute.values(), default=None)  # the machine's best multiply-add rate
    binds = min(bw_rate, fastest) if fastest else bw_rate
    return {
        "streams": streams,
        "active_experts_per_layer": active,
        "step_bytes": step_bytes,
        "step_ops": step_ops,
        "bandwidth_tokens_per_s": bw_rate,
        "compute_tokens_per_s": compute,
        "roofline_tokens_per_s": binds,
        "binding": "bandwidth" if binds == bw_rate else "arithmetic",
    }


def _placement() -> str:
    import torch

    return "hybrid" if torch.cuda.is_available() else "all-int8"


def _rates(
    args, cfg: dict, counts: list[int], bar
) -> tuple[list[dict[int, float]], list[dict[int, float]]]:
    """Every round's tokens/s per stream count, one engine for all of them, and the read
    bandwidth (GB/s) its own probes showed around each (the best of them)."""
    import torch

    from hetserve import LLM, SamplingParams
    from hetserve.bench.moe_kernel import ReadBandwidthProbe

    kwargs: dict = {"cpu_threads": args.threads} if args.threads else {}
    kwargs["activation_bits"] = args.activation_bits
    llm = LLM(str(args.model), placement=_placement(), **kwargs)
    g = torch.Generator().manual_seed(0)
    vocab = cfg["vocab_size"]
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
               for _ in range(max(counts))]  # fmt: skip

    def timed(s: int, n: int) -> Callable[[], object]:
        params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True)
        return lambda: llm.generate(prompt_token_ids=prompts[:s], sampling_params=params)

    probe = ReadBandwidthProbe(args.bandwidth_mib)

    def read() -> list[float]:
        return [probe() for _ in range(PAIRED)]

    rounds: list[dict[int, float]] = []
    reads: list[dict[int, float]] = []
    try:
        for r in range(args.rounds):
            got: dict[int, float] = {}
            seen: dict[int, float] = {}
            for s in counts if r % 2 == 0 else counts[::-1]:
                timed(s, 2)()  # warm-up: this batch width's scratch and plan
                before = read()
                t1 = best_time(timed(s, 1), args.repeats, bar)
                tn = best_time(timed(s, args.tokens), args.repeats, bar)
                seen[s] = max(before + read())
                # As decode_rate: too few tokens to separate decode from noise gives the
                # end-to-end rate, a lower bound, never a division by ~0.
                slow = tn <= t1 * 1.05
                got[s] = s * args.tokens / tn if slow else s * (args.tokens - 1) / (tn - t1)
            rounds.append(got)
            reads.append(seen)
    finally:
        llm.close()  # its weights go before the peaks are measured again
        probe.bufs.clear()  # its buffers go too
        gc.collect()
    return rounds, reads


def run(args: argparse.Namespace, cfg: dict) -> int:
    import torch
    from tqdm import tqdm

    from hetserve.bench.peaks import measure_peaks

    counts = parse_streams(args.streams)
    threads = torch.get_num_threads()
    peaks = measure_peaks(threads, args.bandwidth_mib)
    with tqdm(total=2 * args.repeats * len(counts) * args.rounds, desc="bench decode streams",
              unit="run") as bar:  # fmt: skip
        rounds, reads = _rates(args, cfg, counts, bar)
    peaks = peaks.best(measure_peaks(threads, args.bandwidth_mib))
    report = build_report(args, cfg, counts, rounds, peaks, threads, reads)
    report["activation_bits"] = args.activation_bits
    print_report(report)
    write_json(args.json, report)
    return 0


def build_report(args, cfg: dict, counts: list[int], rounds: list[dict[int, float]], peaks,
                 threads: int, reads: list[dict[int, float]]) -> dict:  # fmt: skip
    """`reads`: per round, the bandwidth each stream count's own probes showed."""
    gops = {kind: peaks.gops.get(kind) for kind in ("int8", "int16")}
    rows = []
    for s in counts:
        rate = max(r[s] for r in rounds)
        roof = step_roofline(cfg, s, peaks.read_gbps, gops)
        own = [
            {"tokens_per_s": r[s], "read_gbps": g[s],
             "fraction_of_roofline":
                 r[s] / step_roofline(cfg, s, g[s], gops)["roofline_tokens_per_s"]}
            for r, g in zip(rounds, reads, strict=True)
        ]  # fmt: skip
        rows.append({**roof, "tokens_per_s": rate,
                     "fraction_of_roofline": rate / roof["roofline_tokens_per_s"],
                     "rounds_own_probes": own,
                     "fraction_own_probes":
                         statistics.median(o["fraction_of_roofline"] for o in own)})  # fmt: skip
    one = rows[0]["tokens_per_s"] if counts[0] == 1 else None
    for row in rows:
        row["vs_one_stream"] = row["tokens_per_s"] / one if one else None
    return {
        "benchmark": "decode-streams",
        **decode_run_fields(args, threads),
        "placement": _placement(),
        "streams": rows,
        "rounds_tokens_per_s": [{str(s): v for s, v in r.items()} for r in rounds],
        "peaks": peaks.to_dict(),
    }


def print_report(report: dict) -> None:
    rows = [[r["streams"], r["tokens_per_s"], r["vs_one_stream"], r["active_experts_per_layer"],
             r["step_bytes"] / 1e6, r["step_ops"] / 1e9, r["bandwidth_tokens_per_s"],
             max(r["compute_tokens_per_s"].values(), default=None), r["binding"],
             r["fraction_of_roofline"], r["fraction_own_probes"]]
            for r in report["streams"]]  # fmt: skip
    print_table(["streams", "decode tok/s", "vs 1 stream", "experts/layer", "MB/step",
                 "GOP/step", "bandwidth-bound tok/s", "compute-bound tok/s", "binds",
                 "of roofline", "own probes"], rows)  # fmt: skip
    p = report["peaks"]
    gops = ", ".join(f"{k} {v:.0f}" for k, v in p["gops"].items() if v)
    print(
        f"peaks on {p['threads']} threads ({p['isa'] or p['note']}): GOPS {gops}; read "
        f"{p['read_gbps']:.1f} GB/s (best of before and after the runs); own probes: each "
        f"round against the best of the {PAIRED} read probes before and {PAIRED} after its "
        "runs, the median of the rounds"
    )
