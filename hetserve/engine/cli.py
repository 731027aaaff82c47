"""`hetserve generate | serve | chat`."""

from __future__ import annotations

import argparse
import json
import sys


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory (default: the demo model)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument(
        "--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bf16"
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens")


def register(sub) -> None:
    from hetserve.server.launch import add_engine_args, add_moe_args, serve

    s = sub.add_parser("serve", help="OpenAI-compatible server (default: the demo model)")
    add_model_args(s)
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require this bearer token on /v1/*")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--log-level", default="warning")
    s.add_argument(
        "--save-routing-stats",
        default=None,
        metavar="FILE",
        help="accumulate expert routing counts and save them here on shutdown",
    )
    s.set_defaults(func=serve)

    c = sub.add_parser("chat", help="terminal chat with a model or a running server")
    add_model_args(c)
    c.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    c.add_argument("--api-key", default=None)
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.7)
    c.set_defaults(func=_chat)

    g = sub.add_parser("generate", help="generate text for prompts (offline)")
    add_model_args(g)
    add_moe_args(g)
    g.add_argument("prompts", nargs="*", help="prompts (read one per line from stdin if none)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--chat", action="store_true", help="apply the chat template to each prompt")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    g.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from hetserve import LLM, SamplingParams
    from hetserve.errors import InvalidInputError

    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise InvalidInputError("no prompt given; pass prompts as arguments or on stdin")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    from dataclasses import asdict

    from hetserve.server.launch import moe_config

    try:
        moe = asdict(moe_config(args))
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None
    llm = LLM(
        args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len, **moe
    )
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": out.text,
                        "token_ids": out.token_ids,
                        "finish_reason": out.finish_reason,
                    }
                )
            )
        else:
            print(f"{prompt!r} -> {out.text!r} ({out.finish_reason})")
    return 0


def _chat(args: argparse.Namespace) -> int:
    from hetserve.engine.chat import chat_loop

    return chat_loop(args)
