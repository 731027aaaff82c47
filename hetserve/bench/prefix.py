"""`hetserve bench prefix`: time to first token with a cold versus a warm prefix cache.

Each prompt shares --shared-frac of its tokens with the others. Cold: a prompt whose prefix was
never seen (fresh prefix per trial). Warm: the same prefix again with a new suffix. TTFT is the
time of a max_tokens=1 request, i.e. the prefill plus one sampling step.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tqdm import tqdm

from hetserve.bench.common import print_table, write_json
from hetserve.config import EngineConfig, add_engine_args
from hetserve.model.synthetic import make_prompts


def register(sub) -> None:
    p = sub.add_parser("prefix", help="TTFT with cold vs warm prefix cache")
    add_engine_args(p)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--shared-frac", type=float, default=0.9)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hetserve import LLM, SamplingParams
    from hetserve.errors import InvalidInputError

    if not 0 < args.shared_frac < 1:
        raise InvalidInputError("--shared-frac must be between 0 and 1")
    llm = LLM(EngineConfig.from_args(args))
    args.model = str(llm.model_dir)
    if args.prompt_len >= llm.max_model_len:
        raise InvalidInputError(f"--prompt-len must be below the context ({llm.max_model_len})")
    shared = int(args.prompt_len * args.shared_frac)
    pool = make_prompts(args.model, 3 * args.trials + 1, args.prompt_len, seed=1)
    params = SamplingParams(max_tokens=1)

    def ttft(ids) -> float:
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=ids, sampling_params=params)
        return time.perf_counter() - t0

    ttft(pool[-1])  # warm-up
    cold, warm, computed = [], [], []
    for t in tqdm(range(args.trials), desc="bench prefix"):
        prefix = pool[3 * t][:shared]
        cold.append(ttft(prefix + pool[3 * t + 1][shared:]))
        before = llm.stats().prompt_tokens_computed
        warm.append(ttft(prefix + pool[3 * t + 2][shared:]))
        computed.append(llm.stats().prompt_tokens_computed - before)  # what the cache did not cover
    c, w = statistics.median(cold), statistics.median(warm)
    print_table(["cache", "median TTFT (s)", "vs cold"], [["cold", c, 1.0], ["warm", w, w / c]])
    write_json(
        args.json,
        {
            "benchmark": "prefix",
            "model": args.model,
            "prompt_len": args.prompt_len,
            "shared_tokens": shared,
            "ttft_cold_s": cold,
            "ttft_warm_s": warm,
            "warm_prompt_tokens_computed": computed,
            "warm_over_cold": w / c,
        },
    )
    return 0
