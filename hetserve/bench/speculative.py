"""`hetserve bench speculative`: decoding with and without drafts, in one run.

Measures: three engines on the same model, each loaded once: plain decoding, ngram drafts as
served by default (each sequence checks only drafts that pay by its acceptance and the engine's
measured cost of checking them) and ngram drafts every step (vLLM's behaviour); and the default
engine given a prediction of each output (OpenAI's Predicted Outputs, what a code edit sends:
decoding's own output with --prediction-edit of it rewritten, a few tokens in every 40);
--rounds alternating rounds of greedy generation of --output-len tokens for each of --streams
prompts (every round in the JSON, best kept). Per engine: output tok/s, engine steps, drafts checked
and held (the acceptance rate), tokens per step; the speedup over plain decoding in the same
run; every engine's outputs must equal decoding's token for token.

What a workload's acceptance can buy is the limit it is read against: the cost of a step that
checks k drafts over a decode step (one sequence's forward and logits, k = 0..K, timed in the
same run at the prompts' context) gives, for drafts that hold with probability a each (until
the first miss), (1 - a^(K+1)) / (1 - a) tokens per step at cost(K): the break-even acceptance
and the speedup at a = 0.5 .. 0.95 (each at its best length) are printed beside the measured
rows. A random checkpoint's
output copies its context only where it falls into loops, so its acceptance says little about a
real model's on code edits or quoted documents; the cost curve is the machine's.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from hetserve.bench.common import model_dir, print_table, require_at_least, write_json
from hetserve.config import EngineConfig, SpeculativeConfig, add_engine_args
from hetserve.core.spec_policy import tokens_per_step
from hetserve.engine.speculative import step_seconds
from hetserve.errors import InvalidInputError
from hetserve.model.synthetic import make_prompts


def register(sub) -> None:
    p = sub.add_parser("speculative", help="decode with and without ngram drafts")
    add_engine_args(p, enable_prefix_caching=False)
    p.add_argument("--streams", type=int, default=1, help="prompts generated together")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (best kept)")
    p.add_argument("--cost-repeats", type=int, default=20, help="forwards per draft count")
    p.add_argument("--prediction-edit", type=float, default=0.1,
                   help="share of each prediction's tokens that differ from the output")
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


def _engine(args, spec: SpeculativeConfig | None):
    from hetserve import LLM

    cfg = EngineConfig.from_args(args)
    return LLM(EngineConfig(**{**cfg.__dict__, "speculative": spec}))


def _round(llm, prompts, params, predictions=None) -> dict:
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params,
                        predictions=predictions)  # fmt: skip
    seconds = time.perf_counter() - t0
    after = llm.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafts = after.spec_draft_tokens - before.spec_draft_tokens
    held = after.spec_accepted_tokens - before.spec_accepted_tokens
    return {
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "steps": after.steps - before.steps,
        "draft_tokens": drafts,
        "accepted_tokens": held,
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def _edited(tokens: list[int], share: float, vocab: int) -> list[int]:
    """`tokens` with the last round(40 * share) of every 40 replaced by other tokens: an
    edit's prediction (the old text) that the output departs from and comes back to."""
    n = round(40 * share)
    return [(t + 1) % vocab if i % 40 >= 40 - n else t for i, t in enumerate(tokens)]


def run(args: argparse.Namespace) -> int:
    from hetserve import SamplingParams

    require_at_least(args, 1, "streams", "input_len", "output_len", "rounds", "cost_repeats")
    args.model = model_dir(args)
    spec = SpeculativeConfig(
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
    )
    prompts = make_prompts(args.model, args.streams, args.input_len)
    n = args.output_len
    params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
    if not 0 <= args.prediction_edit <= 1:
        raise InvalidInputError("--prediction-edit must be within 0..1")
    fixed = dataclasses.replace(spec, adaptive=False)
    plain, drafting = _engine(args, None), _engine(args, spec)
    want = [o.outputs[0].token_ids for o in plain.generate(
        prompt_token_ids=prompts, sampling_params=params)]  # fmt: skip
    vocab = plain.engine.validator.vocab_size
    predicted = [_edited(w, args.prediction_edit, vocab) for w in want]
    systems = {"decode": (plain, None), "ngram drafts": (drafting, None),
               "ngram, every draft": (_engine(args, fixed), None),
               "prediction drafts": (drafting, predicted)}  # fmt: skip
    for llm, _ in systems.values():  # warm-up
        llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=4))
    rounds: dict[str, list[dict]] = {name: [] for name in systems}
    for _ in range(args.rounds):  # alternate: a burst of load hits both
        for name, (llm, preds) in systems.items():
            rounds[name].append(_round(llm, prompts, params, preds))
    same = all(r["outputs"] == want for rs in rounds.values() for r in rs)
    k = args.num_speculative_tokens
    engine = drafting.engine
    costs = step_seconds(engine.runner, engine.kv, k, args.input_len + n // 2, args.cost_repeats,
                         budget_s=float("inf"))  # fmt: skip
    if costs is None:
        raise InvalidInputError("the KV pool has too few free blocks to time the drafts; raise "
                                "--max-model-len or the KV cache size")
    rel = [c / costs[0] for c in costs]
    best = {name: max(rs, key=lambda r: r["tok_s"]) for name, rs in rounds.items()}
    base = best["decode"]["tok_s"]
    rows = []
    for name, r in best.items():
        acc = r["accepted_tokens"] / r["draft_tokens"] if r["draft_tokens"] else None
        rows.append([name, r["tok_s"], r["steps"], acc, args.streams * n / r["steps"],
                     r["tok_s"] / base])  # fmt: skip
    print_table(["system", "tok/s", "steps", "acceptance", "tokens/step", "vs decode"], rows)
    # the best length for each acceptance (what adaptive drafting aims at), and the lowest
    # acceptance at which some length pays
    def limit(a: float) -> float:
        return max(tokens_per_step(a, i) / c for i, c in enumerate(rel))

    even = next((a / 100 for a in range(101) if limit(a / 100) > 1.0 + 1e-9), None)
    limits = {f"speedup at acceptance {a}": limit(a) for a in (0.5, 0.8, 0.9, 0.95)}
    print_table(
        ["drafts k", "step ms", "vs decode step"],
        [[i, c * 1e3, r] for i, (c, r) in enumerate(zip(costs, rel, strict=True))],
    )
    print(f"drafts pay from acceptance {even}; "
          + ", ".join(f"{name} {v:.2f}x" for name, v in limits.items()))  # fmt: skip
    print("outputs equal to decoding's:", same)
    for rs in rounds.values():
        for r in rs:
            r.pop("outputs")
    write_json(
        args.json,
        {
            "benchmark": "speculative",
            "model": args.model,
            "streams": args.streams,
            "input_len": args.input_len,
            "output_len": n,
            "speculative": spec.__dict__,
            "rounds": rounds,
            "speedup": best["ngram drafts"]["tok_s"] / base,
            "speedup_every_draft": best["ngram, every draft"]["tok_s"] / base,
            "speedup_prediction": best["prediction drafts"]["tok_s"] / base,
            "prediction_edit": args.prediction_edit,
            "engine_costs": engine.drafter.costs if engine.drafter is not None else None,
            "outputs_equal": same,
            "step_seconds_by_drafts": costs,
            "break_even_acceptance": even,
            **limits,
        },
    )
    return 0 if same else 1
