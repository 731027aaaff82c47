"""`hetserve bench generate`: single-stream decode tokens/s, hetserve vs transformers, same run.

Decode rate is measured as (N - 1) / (t(N tokens) - t(1 token)) for each system, so prefill and
start-up cost cancel out; both run greedy on the same prompt with the same threads and dtype.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from hetserve.bench.common import decode_rate, model_dir, print_table, require_at_least, write_json
from hetserve.config import EngineConfig, add_engine_args


def register(sub) -> None:
    p = sub.add_parser("generate", help="decode tokens/s of hetserve vs transformers generate")
    add_engine_args(p)
    p.add_argument("--tokens", type=int, default=64, help="tokens to decode per run")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per system (best is kept)")
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.tokens < 2:
        from hetserve.errors import InvalidInputError

        raise InvalidInputError("--tokens must be at least 2")
    require_at_least(args, 1, "prompt_len", "repeats")
    args.model = model_dir(args)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(0))
    ids = ids.tolist()
    systems: dict[str, float | None] = {}
    bar = tqdm(total=4 * args.repeats, desc="bench generate")
    # Each system is loaded inside its own function so its weights are freed before the next.
    systems["hetserve"] = _ours_rate(args, ids, bar)
    systems["transformers"] = _hf_rate(args, ids, bar)
    bar.close()
    base = systems["transformers"]
    rows = [
        [name, rate, (rate / base) if (rate and base) else None] for name, rate in systems.items()
    ]
    print_table(["system", "decode tok/s", "vs transformers"], rows)
    write_json(
        args.json,
        {
            "benchmark": "generate",
            "model": str(args.model),
            "tokens": args.tokens,
            "prompt_len": args.prompt_len,
            "decode_tokens_per_s": systems,
        },
    )
    return 0


def _ours_rate(args, ids, bar) -> float:
    from hetserve import LLM, SamplingParams

    llm = LLM(EngineConfig.from_args(args))

    def ours(n):
        params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0)
        return lambda: llm.generate(prompt_token_ids=ids, sampling_params=params)

    return decode_rate(ours, args.tokens, args.repeats, bar)


def _hf_rate(args, ids, bar) -> float | None:
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: peer skipped (pip install transformers)")
        return None
    dtype = torch.bfloat16 if args.dtype in ("bf16", "bfloat16") else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    inp = torch.tensor([ids])

    def hf(n):
        def go():
            with torch.no_grad():
                model.generate(inp, max_new_tokens=n, min_new_tokens=n, do_sample=False)

        return go

    return decode_rate(hf, args.tokens, args.repeats, bar)
