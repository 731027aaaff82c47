"""`hetserve bench deferral`: what expert deferral buys at decode and what it costs in accuracy.

For d = 0, 1, 2 (clamped by the model to top_k - 2, see layers/moe.py), in one run on one
loaded model:
  * decode tokens/s through the public `LLM.generate` (single stream, greedy, EOS ignored),
    rate (N - 1) / (t(N) - t(1)) as in `bench decode`; d = 0 is timed twice, on the default path
    (the fused native decode where it applies) and layer by layer (the path deferral takes), and
    speedups are reported against both;
  * the KL divergence KL(p_0 || p_d) of the next-token distribution at every decode step, the
    same tokens teacher-forced for every d (the d = 0 greedy continuation), so each step compares
    distributions over the same context; mean and max over `--steps` decode steps.
The KL side drives a private `ModelRunner` (its own small KV cache) because the public API
returns only top-k logprobs, not whole distributions.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from hetserve.bench.common import decode_rate, print_table, require_at_least, write_json


def register(sub) -> None:
    p = sub.add_parser("deferral", help="decode tok/s and KL divergence of expert deferral d=0,1,2")
    p.add_argument("--model", required=True, help="HF MoE checkpoint directory")
    p.add_argument("--placement", default="hybrid", help="placement preset (default hybrid)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the engine's choice)")
    p.add_argument("--defer", default="0,1,2", help="comma-separated d values (0 is the base)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per timed decode run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per d (best kept)")
    p.add_argument("--steps", type=int, default=256, help="decode steps compared for the KL")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", "--result-file", dest="json", default=None, help="write JSON here")
    p.set_defaults(func=run)


def _parse_defer(text: str) -> list[int]:
    from hetserve.errors import InvalidInputError

    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise InvalidInputError(f"--defer expects integers like 0,1,2, got {text!r}") from None
    if not values or values[0] < 0:
        raise InvalidInputError("--defer needs non-negative values")
    return values if values[0] == 0 else [0, *values]


def _rate(llm, ids: list[int], tokens: int, repeats: int) -> float:
    from hetserve import SamplingParams

    def make(n: int) -> Callable[[], object]:
        params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True)
        return lambda: llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)

    return decode_rate(make, tokens, repeats)


def decode_logprobs(model, prompt: list[int], forced: list[int], block_size: int = 16):
    """Next-token log-probabilities [len(forced), V] at each decode step: the prompt is
    prefilled, then `forced` tokens are fed one per decode forward (teacher forcing)."""
    import torch

    from hetserve.engine.runner import ModelRunner, SeqInput

    total = len(prompt) + len(forced)
    blocks = list(range(1, 2 + total // block_size))  # block 0 is the null block
    runner = ModelRunner(model, len(blocks) + 1, block_size)
    hidden = runner.forward([SeqInput(prompt, 0, blocks)])
    rows = [runner.logits(hidden[-1:])]
    done = len(prompt)
    for tok in forced[:-1]:
        hidden = runner.forward([SeqInput([tok], done, blocks)])
        rows.append(runner.logits(hidden))
        done += 1
    return torch.log_softmax(torch.cat(rows).float(), dim=-1)


def kl_stats(base, other) -> dict[str, float]:
    """KL(base || other) per row (both log-probabilities), mean and max, in nats."""
    kl = (base.exp() * (base - other)).sum(-1).clamp_min(0)
    return {"kl_mean": kl.mean().item(), "kl_max": kl.max().item()}


def run(args: argparse.Namespace) -> int:
    import torch

    from hetserve import LLM, SamplingParams
    from hetserve.errors import InvalidInputError

    defer = _parse_defer(args.defer)
    if args.tokens < 2 or args.steps < 2 or args.repeats < 1:
        raise InvalidInputError("--tokens and --steps must be >= 2, --repeats >= 1")
    require_at_least(args, 1, "prompt_len", "threads")
    if args.threads:
        torch.set_num_threads(args.threads)
    options: dict = {"placement": args.placement}
    if args.device:
        options["device"] = args.device
    if args.threads:
        options["cpu_threads"] = args.threads
    llm = LLM(args.model, **options)
    vocab = llm.model.config.vocab_size
    ids = torch.randint(0, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(0))
    prompt = ids.tolist()
    greedy = SamplingParams(max_tokens=args.steps, temperature=0, ignore_eos=True)
    forced = list(llm.generate(prompt_token_ids=[prompt], sampling_params=greedy)[0].token_ids)
    rows = []
    fused = llm.model.fused_step
    default_rate = _rate(llm, prompt, args.tokens, args.repeats)
    llm.model.fused_step = None  # layer by layer from here: the path deferral takes
    base_logprobs = None
    for d in defer:
        applied = llm.model.set_expert_deferral(d)
        rate = _rate(llm, prompt, args.tokens, args.repeats)
        logprobs = decode_logprobs(llm.model, prompt, forced)
        if base_logprobs is None:
            base_logprobs = logprobs
        kl = kl_stats(base_logprobs, logprobs)
        argmax = (logprobs.argmax(-1) == base_logprobs.argmax(-1)).float().mean().item()
        rows.append({"d": d, "applied": applied, "tokens_per_s": rate, **kl, "top1_agree": argmax})
    llm.model.set_expert_deferral(0)
    llm.model.fused_step = fused
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup_vs_d0_layerwise"] = r["tokens_per_s"] / base
        r["speedup_vs_d0_default"] = r["tokens_per_s"] / default_rate
    report = {
        "benchmark": "deferral",
        "model": str(args.model),
        "placement": args.placement,
        "device": str(next(llm.model.parameters()).device),
        "top_k": llm.model.moe_layers()[0].gate.cfg.top_k if llm.model.moe_layers() else None,
        "tokens": args.tokens,
        "steps": args.steps,
        "d0_default_path_tokens_per_s": default_rate,
        "rows": rows,
    }
    print_report(report)
    write_json(args.json, report)
    llm.close()
    return 0


def print_report(report: dict) -> None:
    print(f"d=0 on the default path: {report['d0_default_path_tokens_per_s']:.1f} tok/s")
    headers = ["d", "applied", "tok/s", "x d0 (layerwise)", "x d0 (default)", "KL mean", "KL max"]
    headers.append("top-1 agree")
    print_table(
        headers,
        [
            [r["d"], r["applied"], r["tokens_per_s"], r["speedup_vs_d0_layerwise"],
             r["speedup_vs_d0_default"], r["kl_mean"], r["kl_max"], r["top1_agree"]]
            for r in report["rows"]
        ],
    )  # fmt: skip
