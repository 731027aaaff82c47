"""`bench serve --burst LEN`: long prompts sent into running streams.

The workload's requests are the streams; `--burst-count` prompts of LEN tokens are sent
`--burst-delay` seconds after the first stream. What a server does with them shows in the
streams' inter-token latency: a server that prefills a long prompt in one step freezes every
stream for that step. Measured in the same run: the streams' ITL before the first long prompt
was sent (decode-only), which their ITL p99 and max are divided by; and, with `--burst-solo`
(default on), the TTFT of one more prompt of the same length sent alone after everything
else, which the long prompts' TTFT under load is divided by.

ITL is between content chunks (vLLM's definition). A server holds a token's text back while it
is an incomplete UTF-8 sequence, so one chunk can carry several tokens (random weights pick
such tokens often); the streams ask for usage in every chunk (`continuous_usage_stats`) and
the ITL per token divides such a chunk's gap among its tokens.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from hetserve.bench.model_facts import TokenSpace
from hetserve.bench.serve.client import RequestResult
from hetserve.bench.serve.metrics import summarize
from hetserve.bench.serve.workload import BenchRequest
from hetserve.errors import InvalidInputError

STREAM, BURST, SOLO = "stream", "burst", "solo"


def add_args(p: argparse.ArgumentParser) -> None:
    b = p.add_argument_group("burst (long prompts into running streams)")
    b.add_argument(
        "--burst",
        type=int,
        default=None,
        metavar="LEN",
        help="send --burst-count prompts of LEN tokens into the running streams",
    )
    b.add_argument("--burst-count", type=int, default=1)
    b.add_argument(
        "--burst-delay", type=float, default=1.0, help="seconds after the first stream is sent"
    )
    b.add_argument("--burst-output-len", type=int, default=16)
    b.add_argument(
        "--burst-solo",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="afterwards, one more prompt of LEN tokens alone: the TTFT the burst is held to",
    )


def check_args(args: argparse.Namespace) -> None:
    if args.burst is None:
        return
    if args.burst < 1:
        raise InvalidInputError(f"--burst must be >= 1 token, got {args.burst}")
    if args.burst_count < 1:
        raise InvalidInputError(f"--burst-count must be >= 1, got {args.burst_count}")
    if not args.burst_delay >= 0:
        raise InvalidInputError(f"--burst-delay must be >= 0 seconds, got {args.burst_delay}")
    if args.burst_output_len < 1:
        raise InvalidInputError(f"--burst-output-len must be >= 1, got {args.burst_output_len}")


def requests(
    args: argparse.Namespace, space: TokenSpace, max_model_len: int | None
) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """The long prompts and the solo one: random tokens, each its own (no shared prefix)."""
    length, out = args.burst, args.burst_output_len
    if max_model_len is not None and length + out > max_model_len:
        raise InvalidInputError(
            f"--burst {length} + --burst-output-len {out} exceed the context ({max_model_len})"
        )
    rng = np.random.default_rng([args.seed, 0xB0257])
    n = args.burst_count + (1 if args.burst_solo else 0)
    made = [
        BenchRequest(length, out, token_ids=space.draw(rng, length).tolist(), role=BURST)
        for _ in range(n)
    ]
    if args.burst_solo:
        made[-1].role = SOLO
        return made[:-1], made[-1:]
    return made, []


def metrics(results: list[RequestResult], burst_sent_s: float | None) -> dict[str, Any]:
    """The streams' ITL (all of it, and before the first long prompt was sent), the long
    prompts' TTFT, and the ratios to what the same run measured without them."""
    streams = [r for r in results if r.ok and r.role == STREAM]
    bursts = [r for r in results if r.ok and r.role == BURST]
    solo = [r for r in results if r.ok and r.role == SOLO]
    cut = burst_sent_s if burst_sent_s is not None else float("inf")
    before = [g for r in streams for g, t in zip(r.itls, r.token_s[1:], strict=True) if t <= cut]
    itl = summarize([g for r in streams for g in r.itls])
    base = summarize(before)
    per_token = summarize([g for r in streams for g in r.token_itls])
    token_base = summarize([g for r in streams for g in _token_itls_before(r, cut)])
    ttft = summarize([r.ttft for r in bursts])
    alone = summarize([r.ttft for r in solo])
    return {
        "stream_itl_ms": itl,
        "stream_token_itl_ms": per_token,
        "decode_only_itl_ms": base,
        "decode_only_samples": len(before),
        "itl_p99_over_decode_only": _ratio(itl["p99"], base["median"]),
        "itl_max_over_decode_only": _ratio(itl["max"], base["median"]),
        # Per token, against the per-token baseline: free of the chunks that carry several
        # tokens (held-back UTF-8), which inflate the per-chunk p99 on random weights.
        "decode_only_token_itl_ms": token_base,
        "token_itl_p99_over_decode_only": _ratio(per_token["p99"], token_base["median"]),
        "token_itl_max_over_decode_only": _ratio(per_token["max"], token_base["median"]),
        "burst_ttft_ms": ttft,
        "solo_ttft_ms": alone,
        "burst_ttft_over_solo": _ratio(ttft["max"], alone["median"]),
    }


def _token_itls_before(r: RequestResult, cut: float) -> list[float]:
    """`r.token_itls` of the chunks that arrived by `cut`."""
    if len(r.chunk_tokens) != len(r.token_s):
        return [g for g, t in zip(r.itls, r.token_s[1:], strict=True) if t <= cut]
    out: list[float] = []
    for g, t, k in zip(r.itls, r.token_s[1:], r.chunk_tokens[1:], strict=True):
        if t <= cut:
            out += [g / max(k, 1)] * max(k, 1)
    return out


def _pair(s: dict[str, float | None]) -> str:
    p99, top = s["p99"], s["max"]
    return "n/a" if p99 is None or top is None else f"{p99:.2f} / {top:.2f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table_lines(m: dict[str, Any], row) -> list[str]:
    """The burst section of the terminal table (`row` formats one label and value)."""
    itl, base = m["stream_itl_ms"], m["decode_only_itl_ms"]
    return [
        row("Streams' median ITL (ms):", itl["median"]),
        row("Streams' P99 ITL (ms):", itl["p99"]),
        row("Streams' max ITL (ms):", itl["max"]),
        row("Streams' P99 / max ITL per token (ms):", _pair(m["stream_token_itl_ms"])),
        row("Decode-only median ITL (ms):", base["median"]),
        row("Decode-only ITL samples:", m["decode_only_samples"]),
        row("P99 ITL / decode-only median:", m["itl_p99_over_decode_only"]),
        row("Max ITL / decode-only median:", m["itl_max_over_decode_only"]),
        row("Per token: P99 / decode-only median:", m["token_itl_p99_over_decode_only"]),
        row("Per token: max / decode-only median:", m["token_itl_max_over_decode_only"]),
        row("Long prompts' max TTFT (ms):", m["burst_ttft_ms"]["max"]),
        row("Same prompt alone, TTFT (ms):", m["solo_ttft_ms"]["median"]),
        row("Long prompt TTFT / alone:", m["burst_ttft_over_solo"]),
    ]
