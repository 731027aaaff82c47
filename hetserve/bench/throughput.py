"""`hetserve bench throughput`: offline generation throughput, hetserve vs transformers.

Both systems get the same random prompts and generate exactly the same number of tokens per
request (EOS ignored / suppressed). Lengths vary per request, uniformly within
len * (1 +- --range-ratio), as in a real workload. transformers runs `generate` on left-padded
static batches of --hf-batch, each generating its longest request's length (the shorter ones'
extra tokens are not counted): the cost of static batching that continuous batching removes.
--range-ratio 0 gives equal lengths, transformers' best case.

Both models are loaded once; --repeats timed runs alternate between the two systems (so a burst
of load on a shared machine hits both) and each system's best run is reported, the ratio being
best over best. Every run's time is in the JSON.
"""

from __future__ import annotations

import argparse
import time

import torch

from hetserve.bench.common import model_dir, print_table, require_at_least, write_json
from hetserve.config import EngineConfig, add_engine_args
from hetserve.model.synthetic import make_prompts


def register(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput of hetserve vs transformers")
    # No prefix cache by default: the peer has none, and random prompts share nothing anyway.
    add_engine_args(p, enable_prefix_caching=False)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.5,
        help="lengths uniform in len * (1 +- ratio); 0 = all equal",
    )
    p.add_argument("--hf-batch", type=int, default=16, help="transformers batch size")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per system (best kept)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


def make_lengths(n: int, mean: int, ratio: float, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def _ours(args, prompts, out_lens):
    """A callable timing one offline run of hetserve (loaded and warmed up once)."""
    from hetserve import LLM, SamplingParams

    llm = LLM(EngineConfig.from_args(args))
    params = [
        SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True) for n in out_lens
    ]
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=params[:2])  # warm-up

    def once() -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=True)
        elapsed = time.perf_counter() - t0
        assert [len(o.token_ids) for o in outs] == out_lens
        return elapsed

    return once


def _hf(args, prompts, out_lens):
    """A callable timing one run of transformers `generate` on static batches, or None."""
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: peer skipped")
        return None
    from tqdm import tqdm

    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32
    ).eval()

    def once() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for i in tqdm(range(0, len(prompts), args.hf_batch), desc="transformers"):
                chunk = prompts[i : i + args.hf_batch]
                width = max(len(p) for p in chunk)
                batch = torch.tensor([[0] * (width - len(p)) + p for p in chunk])  # left padding
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
                n = max(out_lens[i : i + args.hf_batch])
                out = model.generate(
                    batch,
                    attention_mask=mask,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                )
                assert out.shape[1] == width + n
        return time.perf_counter() - t0

    return once


def run(args: argparse.Namespace) -> int:
    require_at_least(args, 1, "num_prompts", "input_len", "output_len", "hf_batch", "repeats")
    in_lens = make_lengths(args.num_prompts, args.input_len, args.range_ratio, seed=1)
    out_lens = make_lengths(args.num_prompts, args.output_len, args.range_ratio, seed=2)
    args.model = model_dir(args)
    prompts = make_prompts(args.model, args.num_prompts, args.input_len, lengths=in_lens)
    gen_tokens = sum(out_lens)
    prompt_tokens = sum(in_lens)
    systems = {"hetserve": _ours(args, prompts, out_lens)}
    systems["transformers"] = None if args.skip_hf else _hf(args, prompts, out_lens)
    runs: dict[str, list[float]] = {name: [] for name, fn in systems.items() if fn is not None}
    for _ in range(args.repeats):  # alternate: a burst of load hits both systems
        for name in runs:
            runs[name].append(systems[name]())
    results = {name: (min(runs[name]) if name in runs else None) for name in systems}
    base = results["transformers"]
    rows = []
    for name, secs in results.items():
        if secs is None:
            rows.append([name, None, None, None, None])
            continue
        ratio = (base / secs) if base else None
        rows.append(
            [
                name,
                secs,
                gen_tokens / secs,
                (gen_tokens + prompt_tokens) / secs,
                ratio,
            ]
        )
    print_table(["system", "seconds", "output tok/s", "total tok/s", "speedup vs HF"], rows)
    write_json(
        args.json,
        {
            "benchmark": "throughput",
            "model": args.model,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "repeats": args.repeats,
            "seconds": results,
            "runs_seconds": runs,
            "speedup_vs_transformers": (base / results["hetserve"]) if base else None,
        },
    )
    return 0
