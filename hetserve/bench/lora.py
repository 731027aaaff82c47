"""`hetserve bench lora`: what serving LoRA adapters costs in a batch. Offline throughput (as
`hetserve bench throughput` measures it) of

  base          an engine without LoRA support (nothing LoRA runs): the peer of the others
  lora-off      an engine with LoRA layers installed, requests without an adapter
  1-adapter     every request with the same adapter
  4-adapters    requests round-robin over 4 adapters and the base (one batch, max_loras 4)

Same random prompts and output lengths (EOS ignored) for all; each of --repeats timed rounds
runs every configuration (each round starting with another one, so no configuration always goes
first) and each keeps its best. Random rank-R adapters on every attention projection and
dense/shared MLP linear (what `lora_target: all` trains).
"""

from __future__ import annotations

import argparse
import tempfile
import time

from hetserve.bench.common import model_dir, print_table, write_json

TARGETS = r"self_attn|shared_expert|mlp\.(gate|up|down)_proj"
ADAPTERS = 4


def register(sub) -> None:
    p = sub.add_parser("lora", help="offline throughput with LoRA adapters vs without")
    p.add_argument("--model", default=None, help="HF model directory (default: the demo model)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rank", type=int, default=16, help="the adapters' LoRA rank")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (best kept)")
    p.add_argument("--json", "--result-file", dest="json", default=None, help="write JSON here")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    from hetserve.errors import InvalidInputError

    for flag in ("num_prompts", "input_len", "output_len", "rank", "repeats"):
        if getattr(args, flag) < 1:
            raise InvalidInputError(f"--{flag.replace('_', '-')} must be >= 1")


def _configs(model: str, rank: int, adapters: dict[str, str], n: int) -> dict:
    """name -> (engine, the lora_request of generate) for the four configurations."""
    from hetserve import LLM

    opts = {"enable_prefix_caching": False}  # random prompts share nothing anyway
    base = LLM(model, **opts)
    lora = LLM(model, lora_modules=adapters, max_loras=ADAPTERS, max_lora_rank=rank, **opts)
    names = list(adapters)
    mix = [None if i % 5 == 4 else names[i % 5] for i in range(n)]
    return {
        "base": (base, None),
        "lora-off": (lora, None),
        "1-adapter": (lora, names[0]),
        f"{ADAPTERS}-adapters": (lora, mix),
    }


def _timed_rounds(configs: dict, prompts, params, out_lens: list[int], repeats: int) -> dict:
    for llm, spec in configs.values():  # warm-up
        llm.generate(prompt_token_ids=prompts[:4], sampling_params=params[:4],
                     lora_request=spec[:4] if isinstance(spec, list) else spec)  # fmt: skip
    runs: dict[str, list[float]] = {name: [] for name in configs}
    names = list(configs)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            llm, spec = configs[name]
            t0 = time.perf_counter()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, lora_request=spec)
            runs[name].append(time.perf_counter() - t0)
            assert [len(o.token_ids) for o in outs] == out_lens
    return runs


def run(args: argparse.Namespace) -> int:
    from hetserve import SamplingParams
    from hetserve.bench.throughput import make_lengths
    from hetserve.model.synthetic import make_prompts
    from hetserve.testing.tiny_lora import write_random_adapter

    _check(args)
    args.model = model_dir(args)
    in_lens = make_lengths(args.num_prompts, args.input_len, 0.5, seed=1)
    out_lens = make_lengths(args.num_prompts, args.output_len, 0.5, seed=2)
    prompts = make_prompts(args.model, args.num_prompts, args.input_len, lengths=in_lens)
    params = [SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True)
              for n in out_lens]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        adapters = {
            f"a{i}": str(
                write_random_adapter(args.model, f"{tmp}/a{i}", TARGETS, args.rank, seed=i)
            )
            for i in range(ADAPTERS)
        }
        configs = _configs(args.model, args.rank, adapters, args.num_prompts)
        runs = _timed_rounds(configs, prompts, params, out_lens, args.repeats)
    best = {name: min(r) for name, r in runs.items()}
    tokens = sum(out_lens)
    rate = {name: tokens / secs for name, secs in best.items()}
    vs_base = {name: best["base"] / secs for name, secs in best.items()}
    print_table(
        ["config", "seconds", "output tok/s", "vs base"],
        [[name, best[name], rate[name], vs_base[name]] for name in best],
    )
    write_json(
        args.json,
        {
            "benchmark": "lora",
            "model": args.model,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "rank": args.rank,
            "targets": TARGETS,
            "repeats": args.repeats,
            "output_tokens": tokens,
            "seconds": best,
            "runs_seconds": runs,
            "output_tok_s": rate,
            "vs_base": vs_base,
        },
    )
    return 0
