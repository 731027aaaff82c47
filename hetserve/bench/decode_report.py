"""The report of `hetserve bench decode`: the rates against llama.cpp and transformers, the
roofline (routed expert bytes a token streams against the read bandwidth measured in the run),
the KV dtypes' logprob errors; what `run` in bench/decode.py prints and writes as JSON.

Who calls it: bench/decode.py's `run`. Pure functions of the measured numbers; nothing fails.
"""

from __future__ import annotations

from hetserve.bench.common import decode_run_fields, print_table
from hetserve.bench.weight_bytes import dense_bytes_per_token_fp32, expert_bytes_per_token


def kv_logprob_errors(logprobs: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per KV dtype, the mean and largest |prompt logprob - float32 cache's| (nats)."""
    ref = logprobs.get("float32")
    out = {}
    for name, lp in logprobs.items():
        if ref is not None and name != "float32":
            errs = [abs(a - b) for a, b in zip(lp, ref, strict=True)]
            out[name] = {"mean": sum(errs) / len(errs), "max": max(errs)}
    return out


def _ratios(rates: dict[str, float | None], peer: str) -> dict[str, float | None]:
    base = rates.get(peer)
    return {k: (v / base if v and base else None) for k, v in rates.items()}


def build_report(
    args, cfg: dict, rates: dict[str, float | None], bandwidth: float, threads: int, peer: str
) -> dict:
    experts = expert_bytes_per_token(cfg)
    hybrid = rates.get("hetserve cpu-int8")
    implied = experts["bytes_per_token"] * hybrid / 1e9 if hybrid else None
    dense = dense_bytes_per_token_fp32(cfg)
    total = (experts["bytes_per_token"] + dense) * hybrid / 1e9 if hybrid and dense else None
    return {
        "benchmark": "decode",
        **decode_run_fields(args, threads),
        "decode_tokens_per_s": rates,
        "llamacpp_peer": peer,
        "vs_llamacpp": _ratios(rates, peer),
        "vs_transformers": _ratios(rates, "transformers fp32"),
        "roofline": {
            **experts,
            "hybrid_expert_gbps": implied,
            "bandwidth_gbps": bandwidth,
            "fraction_of_bandwidth": implied / bandwidth if implied else None,
            "dense_bytes_per_token_fp32": dense,
            "hybrid_total_gbps": total,
            "total_fraction_of_bandwidth": total / bandwidth if total else None,
            "bandwidth_measure": (
                f"torch.sum over {args.bandwidth_mib} MiB fp32, best of 8 before and 8 after "
                "the systems run"
            ),
        },
    }


def print_report(report: dict) -> None:
    rates = report["decode_tokens_per_s"]
    vs_ll, vs_hf = report["vs_llamacpp"], report["vs_transformers"]
    rows = [[name, rate, vs_ll[name], vs_hf[name]] for name, rate in rates.items()]
    print_table(
        ["system", "decode tok/s", f"vs {report['llamacpp_peer']}", "vs transformers"], rows
    )
    for name, e in report.get("kv_logprob_error_vs_float32", {}).items():
        print(
            f"all-int8 kv={name}: prompt logprobs vs a float32 KV cache: mean |diff| "
            f"{e['mean']:.2e}, largest {e['max']:.2e} nats ({report['prompt_len'] - 1} positions)"
        )
    for name, ratio in report.get("numa_auto_vs_off", {}).items():
        print(f"{name}: --numa auto / off = {ratio:.3f}")
    r = report["roofline"]
    implied = r["hybrid_expert_gbps"]
    implies = (
        "the hybrid row was skipped"
        if not implied
        else f"hybrid implies {implied:.1f} GB/s of {r['bandwidth_gbps']:.1f} GB/s measured "
        f"read bandwidth ({report['threads']} threads) = {r['fraction_of_bandwidth']:.2f}"
    )
    print(
        f"routed experts streamed per token (int8): {r['bytes_per_token'] / 1e6:.1f} MB "
        f"({r['top_k']} x {r['expert_bytes'] / 1e6:.2f} MB x {r['moe_layers']} MoE layers); "
        f"{implies}"
    )
    if r["hybrid_total_gbps"]:
        # On a machine without an accelerator the non-expert weights stream from DRAM too (fp32).
        print(
            f"plus non-expert weights at fp32: {r['dense_bytes_per_token_fp32'] / 1e6:.1f} MB per "
            f"token; all weights streamed imply {r['hybrid_total_gbps']:.1f} GB/s = "
            f"{r['total_fraction_of_bandwidth']:.2f} of measured bandwidth"
        )
