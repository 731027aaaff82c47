"""`hetserve calibrate`: routing statistics for `--gpu-experts`."""

from __future__ import annotations

import argparse
from pathlib import Path

from hetserve.config import add_engine_args
from hetserve.errors import InvalidInputError


def register(sub) -> None:
    c = sub.add_parser("calibrate", help="run prompts and save per-layer expert routing counts")
    add_engine_args(c)
    c.set_defaults(record_routing_stats=True)
    c.add_argument("--out", required=True, help="statistics JSON to write")
    c.add_argument("--prompts", default=None, help="text file, one prompt per line")
    c.add_argument("--num-prompts", type=int, default=32, help="random prompts if no --prompts")
    c.add_argument("--prompt-len", type=int, default=256)
    c.add_argument("--max-tokens", type=int, default=16, help="decode tokens per prompt")
    c.set_defaults(func=_calibrate)


def _calibrate(args: argparse.Namespace) -> int:
    from hetserve.bench.common import require_at_least
    from hetserve.config import EngineConfig
    from hetserve.core.sampling import SamplingParams
    from hetserve.engine.llm import LLM
    from hetserve.moe.routing_stats import choose_gpu_experts

    # The cheap mistakes before the model loads and the prompts run
    require_at_least(args, 1, "num_prompts", "prompt_len", "max_tokens")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise InvalidInputError(f"--out {args.out}: directory {str(out.parent)!r} does not exist")
    if args.prompts and not Path(args.prompts).is_file():
        raise InvalidInputError(f"prompt file {args.prompts!r} does not exist")
    llm = LLM(EngineConfig.from_args(args))
    stats = llm.routing_stats()
    if stats is None or not llm.model.moe_layers():
        raise InvalidInputError(f"{args.model} has no MoE layers; nothing to calibrate")
    if args.prompts:
        path = Path(args.prompts)
        if not path.is_file():
            raise InvalidInputError(f"prompt file {args.prompts!r} does not exist")
        texts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        if not texts:
            raise InvalidInputError(f"prompt file {args.prompts!r} has no prompts")
        ids = [llm.tokenizer.encode(t)[: llm.max_model_len - args.max_tokens] for t in texts]
    else:
        from hetserve.model.synthetic import make_prompts

        ids = make_prompts(str(llm.model_dir), args.num_prompts, args.prompt_len)
    llm.generate(
        prompt_token_ids=ids,
        use_tqdm=True,
        sampling_params=SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True),
    )
    stats.save(args.out)
    hot = choose_gpu_experts(stats, 4)
    for layer, experts in sorted(hot.items())[:8]:
        print(f"layer {layer}: hottest experts {experts}")
    print(f"wrote routing statistics of {len(stats.layers())} MoE layers to {args.out}")
    return 0
