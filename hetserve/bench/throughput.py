"""`hetserve bench throughput`: offline generation throughput, hetserve vs transformers.

Both systems get the same random prompts and generate exactly --output-len tokens per prompt
(EOS ignored / suppressed). transformers runs `generate` on left-padded batches of --hf-batch.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hetserve.bench.common import print_table, write_json


def register(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput of hetserve vs transformers")
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--hf-batch", type=int, default=16, help="transformers batch size")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


def make_prompts(model_dir: str, n: int, length: int, seed: int = 0) -> list[list[int]]:
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    # Ids from the low range only: random tiny tokenizers map high ids to special tokens.
    return torch.randint(10, min(vocab, 400), (n, length), generator=g).tolist()


def _ours(args, prompts) -> float:
    from hetserve import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False)
    params = SamplingParams(
        max_tokens=args.output_len, min_tokens=args.output_len, temperature=0, ignore_eos=True
    )
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=params)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    assert all(len(o.token_ids) == args.output_len for o in outs)
    return elapsed


def _hf(args, prompts) -> float | None:
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: peer skipped")
        return None
    from tqdm import tqdm

    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32
    ).eval()
    n = args.output_len
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in tqdm(range(0, len(prompts), args.hf_batch), desc="transformers"):
            batch = torch.tensor(prompts[i : i + args.hf_batch])  # equal lengths: no padding
            out = model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
            )
            assert out.shape[1] == batch.shape[1] + n
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    prompts = make_prompts(args.model, args.num_prompts, args.input_len)
    gen_tokens = args.num_prompts * args.output_len
    results = {"hetserve": _ours(args, prompts)}
    results["transformers"] = None if args.skip_hf else _hf(args, prompts)
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
                (gen_tokens + args.num_prompts * args.input_len) / secs,
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
            "seconds": results,
            "speedup_vs_transformers": (base / results["hetserve"]) if base else None,
        },
    )
    return 0
