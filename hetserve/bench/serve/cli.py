"""`hetserve bench serve`: load-test any OpenAI-compatible server and report serving metrics.

Example: hetserve bench serve --base-url http://127.0.0.1:8000 --model m --dataset random
--request-rate 4 --num-prompts 200 --slo ttft=500,tpot=50 --result-file out.json --plot plots/
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path
from typing import Any

from hetserve import envs
from hetserve.bench.model_facts import ModelFacts, TokenSpace, learn_model_facts, require_vocab
from hetserve.bench.serve import burst
from hetserve.errors import InvalidInputError

DATASETS = ("random", "structured", "sharegpt", "multiturn", "mooncake-trace")
# Requests per run when --num-prompts is not given (conversations for multiturn; None = all).
_DEFAULT_NUM = {
    "random": 1000,
    "structured": 200,
    "sharegpt": 1000,
    "multiturn": 64,
    "mooncake-trace": None,
}
# Ids that only pick words for chat prompts (the vocabulary does not matter there).
_WORD_IDS = 1000


def register(bench_sub: Any) -> None:
    p = bench_sub.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, goodput)",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name sent in each request")
    p.add_argument(
        "--endpoint",
        default=None,
        help="default /v1/completions (/v1/chat/completions for multiturn)",
    )
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    d = p.add_argument_group("workload")
    d.add_argument("--dataset", choices=DATASETS, default="random")
    d.add_argument("--dataset-path", default=None, help="ShareGPT JSON or Mooncake trace JSONL")
    d.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests (conversations for "
        "multiturn); default 1000, 64 for multiturn, the whole trace",
    )
    d.add_argument(
        "--structured-ratio",
        type=float,
        default=0.5,
        help="structured dataset: share of requests under json_schema (the same load without "
        "grammars runs first, as the peer)",
    )
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- ratio)"
    )
    d.add_argument(
        "--random-prefix-ratio",
        type=float,
        default=0.0,
        help="share of the prompt that is the same in every request",
    )
    d.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="override the output length taken from the reply",
    )
    d.add_argument("--multiturn-turns", type=int, default=4)
    d.add_argument("--multiturn-user-len", type=int, default=64, help="words per user message")
    d.add_argument("--multiturn-output-len", type=int, default=64)
    d.add_argument(
        "--session-ids",
        action="store_true",
        help="each conversation sends its own session_id (hetserve keeps its KV for a TTL)",
    )
    d.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="the model's directory (config.json, tokenizer.json) or a tokenizer.json: "
        "vocabulary, context, special tokens to avoid, exact text lengths",
    )
    d.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="override the vocabulary the server (/v1/models) or --tokenizer reports",
    )
    d.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="fit prompt + output into this many tokens (default: the server's context)",
    )
    d.add_argument("--max-model-len-mode", choices=("clip", "scale"), default="clip")
    d.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default on for random, multiturn and traces",
    )
    a = p.add_argument_group("arrivals")
    a.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson req/s or inf (default: trace timestamps, else inf)",
    )
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--max-concurrency", type=int, default=None)
    a.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply trace timestamps (0.5 replays twice as fast)",
    )
    a.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds")
    o = p.add_argument_group("output")
    o.add_argument("--slo", default=None, help="e.g. ttft=200,tpot=50 (ms; also e2el)")
    o.add_argument("--result-file", "--json", dest="result_file", default=None,
                   help="write the result as JSON here")  # fmt: skip
    o.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots here")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    burst.add_args(p)
    p.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> None:
    if args.dataset in ("sharegpt", "mooncake-trace") and not args.dataset_path:
        raise InvalidInputError(f"--dataset {args.dataset} needs --dataset-path FILE")
    if args.dataset_path and not Path(args.dataset_path).is_file():
        raise InvalidInputError(f"--dataset-path: file not found: {args.dataset_path}")
    if args.request_rate is not None and not args.request_rate > 0:
        raise InvalidInputError(f"--request-rate must be > 0 or inf, got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise InvalidInputError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not (args.time_scale > 0 and math.isfinite(args.time_scale)):
        raise InvalidInputError(f"--time-scale must be > 0, got {args.time_scale}")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise InvalidInputError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.vocab_size is not None and args.vocab_size < 2:
        raise InvalidInputError(f"--vocab-size must be >= 2, got {args.vocab_size}")
    if args.endpoint is not None and not args.endpoint.startswith("/"):
        raise InvalidInputError(f"--endpoint must be a path like /v1/completions: {args.endpoint}")
    if not (args.request_timeout > 0 and math.isfinite(args.request_timeout)):
        raise InvalidInputError(f"--request-timeout must be > 0 seconds: {args.request_timeout}")
    if args.result_file and Path(args.result_file).is_dir():
        raise InvalidInputError(f"--result-file: {args.result_file} is a directory")
    if not args.base_url.startswith(("http://", "https://")):
        raise InvalidInputError(f"--base-url must start with http:// or https://: {args.base_url}")
    burst.check_args(args)


def build_workload(args: argparse.Namespace, facts: ModelFacts):
    """The dataset's requests, fitted to the model's context and drawn from its vocabulary."""
    from hetserve.bench.serve import datasets as ds
    from hetserve.bench.serve.trace import trace_workload

    num = args.num_prompts if args.num_prompts is not None else _DEFAULT_NUM[args.dataset]
    fit = {"max_model_len": facts.max_model_len, "fit_mode": args.max_model_len_mode}
    if args.dataset in ("random", "structured"):
        workload = ds.random_workload(
            num,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_ratio,
            _token_space(args, facts),
            args.seed,
            **fit,
        )
        if args.dataset == "structured":
            workload = ds.structured_workload(workload, args.structured_ratio)
    elif args.dataset == "sharegpt":
        workload = ds.sharegpt_workload(
            args.dataset_path,
            num,
            args.sharegpt_output_len,
            args.tokenizer,
            args.seed,
            **fit,
            vllm_filter=args.max_model_len is None,
        )
    elif args.dataset == "multiturn":
        workload = ds.multiturn_workload(
            num,
            args.multiturn_turns,
            args.multiturn_user_len,
            args.multiturn_output_len,
            args.dataset_path,
            args.tokenizer,
            args.seed,
            facts.max_model_len,
        )
    else:
        workload = trace_workload(args.dataset_path, num, _token_space(args, facts), **fit)
    workload.notes[:0] = facts.notes()
    return workload


def _token_space(args: argparse.Namespace, facts: ModelFacts) -> TokenSpace:
    """Token ids for prompts; the vocabulary must be known when they are sent as ids."""
    from hetserve.bench.serve.client import is_chat

    if is_chat(_endpoint(args)) and facts.vocab_size is None:
        return TokenSpace(_WORD_IDS)  # chat sends words picked by these ids, never the ids
    require_vocab(facts, args.base_url, args.model)
    return facts.token_space()


def _endpoint(args: argparse.Namespace) -> str:
    if args.endpoint:
        return args.endpoint
    return "/v1/chat/completions" if args.dataset == "multiturn" else "/v1/completions"


def run(args: argparse.Namespace) -> int:
    from hetserve.bench.serve.metrics import compute_metrics, parse_slo
    from hetserve.bench.serve.report import format_table, write_plots
    from hetserve.bench.serve.runner import run_benchmark

    _check_args(args)
    slo = parse_slo(args.slo)  # before the run: a typo must not cost a whole benchmark
    cfg = _run_config(args)
    facts = learn_model_facts(
        args.base_url, args.model, cfg.api_key, args.tokenizer, args.vocab_size, args.max_model_len
    )
    workload = build_workload(args, facts)
    baseline = None
    if args.dataset == "structured":  # the peer: the same load with no grammar, run first
        from hetserve.bench.serve.datasets import without_grammars

        b_results, b_start, b_end = asyncio.run(run_benchmark(without_grammars(workload), cfg))
        baseline = (b_results, compute_metrics(b_results, b_start, b_end, slo))
    bursts, solo = ([], [])
    if args.burst is not None:
        bursts, solo = burst.requests(args, _token_space(args, facts), facts.max_model_len)
    extra = [(args.burst_delay, r) for r in bursts]
    results, start, end = asyncio.run(run_benchmark(workload, cfg, extra=extra))
    metrics = compute_metrics(results, start, end, slo)
    if args.burst is not None:
        metrics["burst"] = _burst_metrics(results, solo, workload, cfg)
    if len(results) - len(extra) < workload.num_requests:
        skipped = workload.num_requests - len(results) + len(extra)
        workload.notes.append(f"{skipped} later turns not sent: an earlier turn of theirs failed")
    result = _result(args, cfg, workload, metrics, results, start)
    if baseline is not None:
        from hetserve.bench.serve.report import structured_comparison

        result["baseline_metrics"] = baseline[1]
        result["structured"] = structured_comparison(workload, results, *baseline)
    print(format_table(result))
    if args.result_file:
        _write(args.result_file, result)
    if args.plot:
        try:
            for path in write_plots(args.plot, results, metrics):
                print(f"wrote {path}")
        except OSError as exc:
            raise InvalidInputError(f"--plot: cannot write to {args.plot} ({exc})") from exc
    if results and not metrics["completed"]:
        print("error: every request failed (see Errors above)", file=sys.stderr)
        return 1
    return 0


def _burst_metrics(results, solo, workload, cfg) -> dict[str, Any]:
    """Once the streams and long prompts are done, the solo prompt alone; then the burst's
    figures (burst.py)."""
    from hetserve.bench.serve.runner import run_benchmark
    from hetserve.bench.serve.workload import Workload

    alone: list = []
    if solo:
        only = Workload("burst-solo", [solo], workload.ignore_eos)
        alone, _, _ = asyncio.run(run_benchmark(only, cfg))
    sent = [r.send_s for r in results if r.role == burst.BURST]
    return burst.metrics(results + alone, min(sent) if sent else None)


def _run_config(args: argparse.Namespace):
    from hetserve.bench.serve.runner import RunConfig

    return RunConfig(
        base_url=args.base_url,
        endpoint=_endpoint(args),
        model=args.model,
        api_key=args.api_key or envs.openai_api_key(),
        request_rate=args.request_rate,
        seed=args.seed,
        max_concurrency=args.max_concurrency,
        time_scale=args.time_scale,
        ignore_eos=args.ignore_eos,
        request_timeout_s=args.request_timeout,
        progress=not args.disable_tqdm,
        session_ids=args.session_ids,
        continuous_usage=args.burst is not None,
    )


def _result(args, cfg, workload, metrics, results, start) -> dict[str, Any]:
    """The JSON document: options, workload facts, metrics and one row per request."""
    from hetserve.bench.serve.runner import arrival_offsets

    _, arrivals = arrival_offsets(workload, cfg.request_rate, cfg.seed, cfg.time_scale)
    return {
        # The command's options, to rerun it; never the API key.
        "args": {k: _plain(v) for k, v in vars(args).items() if k not in ("func", "api_key")},
        "dataset": workload.name,
        "endpoint": cfg.endpoint,
        "url": cfg.url,
        "model": cfg.model,
        "arrivals": arrivals,
        "max_concurrency": cfg.max_concurrency,
        "ignore_eos": workload.ignore_eos if cfg.ignore_eos is None else cfg.ignore_eos,
        "notes": workload.notes,
        "prefix_reuse": workload.prefix_reuse,
        "metrics": metrics,
        "requests": [_request_row(r, start) for r in results],
    }


def _write(path: str, result: dict[str, Any]) -> None:
    from hetserve.bench.common import write_json  # the house JSON layout, with machine info

    try:
        write_json(path, result)
    except OSError as exc:
        raise InvalidInputError(f"--result-file: cannot write {path} ({exc})") from exc


def _plain(value: Any) -> Any:
    """Non-finite floats as strings ("inf"): JSON has no Infinity and strict parsers reject it."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def _request_row(r: Any, start: float) -> dict[str, Any]:
    return {
        "send_s": r.send_s - start,
        "prompt_len": r.prompt_len,
        "output_tokens": r.output_tokens,
        "ttft_s": r.ttft if r.ok else None,
        "e2e_s": r.e2e,
        "tpot_s": r.tpot if r.ok else None,
        "role": r.role,
        "token_s": [t - start for t in r.token_s],  # each content chunk's arrival
        "chunk_tokens": r.chunk_tokens,  # and its tokens, where usage came with every chunk
        "error": r.error,
    }
