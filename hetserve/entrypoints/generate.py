"""`hetserve generate`: offline generation for prompts given as arguments or on stdin."""

from __future__ import annotations

import argparse
import json
import sys

from hetserve.config import add_engine_args


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate text for prompts (offline)")
    add_engine_args(g)
    g.add_argument("prompts", nargs="*", help="prompts (read one per line from stdin if none)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--chat", action="store_true", help="apply the chat template to each prompt")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    g.add_argument("--lora", default=None, metavar="NAME|DIR",
                   help="generate with this LoRA adapter: a PEFT directory, or the name of one "
                        "given with --lora-modules")  # fmt: skip
    g.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hetserve import LLM, SamplingParams
    from hetserve.config import EngineConfig
    from hetserve.errors import InvalidInputError

    adapter = args.lora
    if adapter is not None and Path(adapter).is_dir():  # a directory: loaded under its name
        adapter = Path(adapter).resolve().name or "adapter"
        args.lora_modules = [*(args.lora_modules or ()), f"{adapter}={args.lora}"]
    config = EngineConfig.from_args(args)  # its mistakes first (a flag that took the prompts)
    if adapter is not None and adapter not in dict(config.lora.lora_modules):
        raise InvalidInputError(f"--lora {args.lora!r} is neither an adapter directory nor a "
                                "name given with --lora-modules")  # fmt: skip
    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise InvalidInputError("no prompt given; pass prompts as arguments or on stdin")
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
        )
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None
    llm = LLM(config)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                        lora_request=adapter)  # fmt: skip
    else:
        outs = llm.generate(prompts, params, lora_request=adapter)
    for prompt, out in zip(prompts, outs, strict=True):
        if args.json:
            record = {
                "prompt": prompt,
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
            }
            print(json.dumps(record))
        else:
            print(f"{prompt!r} -> {out.text!r} ({out.finish_reason})")
    return 0
