"""What LoRA costs in a batch: offline throughput (as `hetserve bench throughput` measures it) of

  base          an engine without LoRA support (nothing LoRA runs)
  lora-off      an engine with LoRA layers installed, requests without an adapter
  1-adapter     every request with the same adapter
  4-adapters    requests round-robin over 4 adapters and the base (one batch, max_loras=4)

Same random prompts and output lengths (EOS ignored) for all; each of --repeats timed rounds
runs every configuration (each round starting with another one) and each keeps its best. Random
rank-R adapters on every attention projection and dense/shared MLP linear (what `lora_target:
all` trains). Run it under the heavy lock:

    flock /tmp/hetserve-heavy.lock .venv/bin/python scripts/bench_lora.py --model DIR
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from hetserve import LLM, SamplingParams
from hetserve.model.synthetic import make_prompts
from hetserve.testing.tiny_lora import write_random_adapter

TARGETS = r"self_attn|shared_expert|mlp\.(gate|up|down)_proj"


def lengths(n: int, mean: int, ratio: float, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lo, hi = max(1, int(mean * (1 - ratio))), int(mean * (1 + ratio))
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    in_lens = lengths(args.num_prompts, args.input_len, 0.5, seed=1)
    out_lens = lengths(args.num_prompts, args.output_len, 0.5, seed=2)
    prompts = make_prompts(args.model, args.num_prompts, args.input_len, lengths=in_lens)
    params = [SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True)
              for n in out_lens]  # fmt: skip
    tmp = tempfile.mkdtemp(prefix="bench-lora-")
    adapters = {
        f"a{i}": str(write_random_adapter(args.model, f"{tmp}/a{i}", TARGETS, args.rank, seed=i))
        for i in range(4)
    }
    opts = {"enable_prefix_caching": False}
    base = LLM(args.model, **opts)
    lora = LLM(args.model, lora_modules=adapters, max_loras=4, max_lora_rank=args.rank, **opts)
    mix = [None if i % 5 == 4 else f"a{i % 5}" for i in range(args.num_prompts)]
    configs = {
        "base": (base, None),
        "lora-off": (lora, None),
        "1-adapter": (lora, "a0"),
        "4-adapters": (lora, mix),
    }
    for llm, spec in configs.values():  # warm-up
        llm.generate(prompt_token_ids=prompts[:4], sampling_params=params[:4],
                     lora_request=spec[:4] if isinstance(spec, list) else spec)  # fmt: skip
    runs: dict[str, list[float]] = {name: [] for name in configs}
    names = list(configs)
    for r in range(args.repeats):  # each round in another order: no config always goes first
        for name in names[r % len(names) :] + names[: r % len(names)]:
            llm, spec = configs[name]
            t0 = time.perf_counter()
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, lora_request=spec)
            runs[name].append(time.perf_counter() - t0)
            assert [len(o.token_ids) for o in outs] == out_lens
    best = {name: min(r) for name, r in runs.items()}
    tokens = sum(out_lens)
    print(f"{'config':<12} {'seconds':>8} {'output tok/s':>13} {'vs base':>8}")
    for name, secs in best.items():
        print(f"{name:<12} {secs:8.3f} {tokens / secs:13.1f} {best['base'] / secs:8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "lora", **vars(args), "best_s": best, "runs_s": runs}, f)


if __name__ == "__main__":
    main()
