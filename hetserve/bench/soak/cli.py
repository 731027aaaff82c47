"""`hetserve bench soak`: hold a server under mixed, hostile load and check that it stays whole.

Example: hetserve bench soak --url http://127.0.0.1:8000 --concurrency 64 --duration 300
--json soak.json --plot plots/
"""

from __future__ import annotations

import argparse
import asyncio
import math
from pathlib import Path
from typing import Any

from hetserve import envs
from hetserve.bench.common import add_server_args
from hetserve.errors import InvalidInputError


def register(bench_sub: Any) -> None:
    p = bench_sub.add_parser(
        "soak",
        help="mixed load with disconnects and bad requests; checks failures, KV blocks, memory",
        description=__doc__.splitlines()[0],
    )
    add_server_args(p)
    p.add_argument("--model", default=None, help="model name (default: the one /v1/models lists)")
    p.add_argument("--concurrency", type=int, default=64, help="clients sending at once")
    p.add_argument(
        "--duration",
        type=float,
        default=300.0,
        help="seconds of load (every case goes at least once, even if that is longer)",
    )
    p.add_argument("--max-tokens", type=int, default=32, help="longest output of a good request")
    p.add_argument(
        "--skip-cases",
        default="",
        metavar="A,B",
        help="cases not to send (e.g. chat-tools-required on a server without tools)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="the model's directory: vocabulary when the server does not report it",
    )
    p.add_argument("--vocab-size", type=int, default=None, help="override the vocabulary size")
    p.add_argument(
        "--oversized-mb",
        type=float,
        default=9.0,
        help="size of the chunked oversized body (over the server's limit)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=60.0,
        help="seconds before an unanswered request counts as failed",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=60.0,
        help="seconds to wait after the load for the server to go idle",
    )
    p.add_argument("--sample-interval", type=float, default=1.0, help="seconds between /metrics")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the result as JSON here")
    p.add_argument("--plot", default=None, metavar="DIR", help="write soak.png here")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=run)  # fmt: skip


def _check_args(args: argparse.Namespace) -> None:
    if not args.url.startswith(("http://", "https://")):
        raise InvalidInputError(f"--url must start with http:// or https://: {args.url}")
    for name in ("concurrency", "max_tokens"):
        if getattr(args, name) < 1:
            raise InvalidInputError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("duration", "request_timeout", "idle_timeout", "sample_interval", "oversized_mb"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise InvalidInputError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.json and Path(args.json).is_dir():
        raise InvalidInputError(f"--json: {args.json} is a directory")


def _context(args: argparse.Namespace, api_key: str | None):
    from hetserve.bench.model_facts import learn_model_facts
    from hetserve.bench.server_info import model_cards
    from hetserve.bench.soak.cases import Context

    model = args.model
    if model is None:
        cards = model_cards(args.url, api_key)
        if not cards:
            raise InvalidInputError(f"{args.url}/v1/models lists no model; give --model NAME")
        model = str(cards[0].get("id"))
    facts = learn_model_facts(args.url, model, api_key, args.tokenizer, args.vocab_size)
    return Context(
        model=model,
        vocab_size=facts.vocab_size,
        max_model_len=facts.max_model_len,
        # Without a known vocabulary, good prompts are text and the bad id is 2^31 - 1.
        space=facts.token_space() if facts.vocab_size is not None else None,
        max_tokens=args.max_tokens,
        oversized_bytes=int(args.oversized_mb * (1 << 20)),
    ), facts


def run(args: argparse.Namespace) -> int:
    from hetserve.bench.common import write_json
    from hetserve.bench.soak.cases import select_cases
    from hetserve.bench.soak.report import print_report, summarize, write_plot
    from hetserve.bench.soak.runner import SoakConfig, run_soak

    _check_args(args)
    try:
        cases = select_cases([s.strip() for s in args.skip_cases.split(",") if s.strip()])
    except ValueError as exc:
        raise InvalidInputError(f"--skip-cases: {exc}") from None
    if not cases:
        raise InvalidInputError("--skip-cases leaves nothing to send")
    api_key = args.api_key or envs.openai_api_key()
    ctx, facts = _context(args, api_key)
    cfg = SoakConfig(
        base_url=args.url,
        concurrency=args.concurrency,
        duration_s=args.duration,
        cases=cases,
        api_key=api_key,
        request_timeout_s=args.request_timeout,
        idle_timeout_s=args.idle_timeout,
        sample_interval_s=args.sample_interval,
        seed=args.seed,
        progress=not args.disable_tqdm,
    )
    summary = summarize(asyncio.run(run_soak(cfg, ctx)))
    header = {"url": args.url, "model": ctx.model, "concurrency": args.concurrency,
              "duration_s": args.duration, "load_s": round(summary["load_s"], 1)}  # fmt: skip
    print_report(summary, header)
    for note in facts.notes():
        print(f"note: {note}")
    if args.json:
        options = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
        doc = {"benchmark": "soak", **header, "args": options, "notes": facts.notes(), **summary}
        try:
            write_json(args.json, doc)
        except OSError as exc:
            raise InvalidInputError(f"--json: cannot write {args.json} ({exc})") from exc
    if args.plot:
        try:
            print(f"wrote {write_plot(args.plot, summary)}")
        except OSError as exc:
            raise InvalidInputError(f"--plot: cannot write to {args.plot} ({exc})") from exc
    return 0 if summary["verdict"]["ok"] else 1
