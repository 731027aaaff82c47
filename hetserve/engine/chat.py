"""`hetserve chat`: a streaming terminal chat, in-process or against any OpenAI server."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator

import httpx

from hetserve import envs
from hetserve.errors import InvalidInputError


def _remote_stream(args, messages: list[dict]) -> Iterator[str]:
    key = args.api_key or envs.api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {
        "messages": messages,
        "stream": True,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
    }
    url = args.url.rstrip("/") + "/v1/chat/completions"
    try:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=None) as r:
            if r.status_code != 200:
                r.read()
                raise InvalidInputError(f"server answered {r.status_code}: {r.text[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    yield choice.get("delta", {}).get("content") or ""
    except httpx.HTTPError as exc:
        msg = f"cannot reach {args.url}: {exc}; is the server running?"
        raise InvalidInputError(msg) from None


def _local_stream(engine, args, messages: list[dict]) -> Iterator[str]:
    from hetserve import SamplingParams

    prompt = engine.tokenizer.apply_chat_template(messages)
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    room = engine.max_model_len - len(ids)
    if room < 1:
        raise InvalidInputError("the conversation no longer fits the context; start a new one")
    params = SamplingParams(max_tokens=min(args.max_tokens, room), temperature=args.temperature)
    rid = f"chat-{len(messages)}"
    engine.add_request(rid, ids, params)
    sent = 0
    while engine.has_unfinished():
        for out in engine.step():
            text = out.outputs[0].text
            yield text[sent:]
            sent = len(text)


def chat_loop(args: argparse.Namespace) -> int:
    engine = None
    if args.url is None:
        from hetserve.config import EngineConfig
        from hetserve.engine.core import EngineCore

        engine = EngineCore(EngineConfig.from_args(args))
    messages: list[dict] = []
    print("type a message; an empty line or Ctrl-D quits", file=sys.stderr)
    for line in sys.stdin:
        line = line.rstrip("\n")
        if not line:
            break
        messages.append({"role": "user", "content": line})
        stream = (
            _remote_stream(args, messages)
            if engine is None
            else _local_stream(engine, args, messages)
        )
        reply = []
        for piece in stream:
            reply.append(piece)
            print(piece, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0
