"""`hetserve chat`: a streaming terminal chat, in-process or against any OpenAI server.

After each reply it prints the prompt and generation timings as the KTransformers tutorial shows
them (ollama's names). Prompt eval: the prompt tokens actually computed (those not found in the
prefix cache) over the time from sending the request to the first generated token. Eval: the
tokens generated after the first over the time from the first to the last. In-process the times
are the engine's steps as seen by this loop; with `--url` they are measured here, at the client,
from the stream's chunks, and the counts come from the stream's `usage` (or, for a server that
sends none, from its chunks).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hetserve import envs
from hetserve.config import add_engine_args
from hetserve.errors import InvalidInputError


@dataclass
class ReplyStats:
    start: float
    first: float | None = None  # first generated token seen
    last: float | None = None  # last generated token seen
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    counted_from_stream: bool = False

    def seen(self, now: float) -> None:
        if self.first is None:
            self.first = now
        self.last = now

    def lines(self) -> list[str]:
        first = self.first if self.first is not None else time.perf_counter()
        last = self.last if self.last is not None else first
        prompt = self.prompt_tokens - self.cached_tokens
        gen = max(self.completion_tokens - 1, 0)
        note = " (counted from the stream)" if self.counted_from_stream else ""
        return [
            f"prompt eval count:    {prompt} token(s)",
            f"prompt eval duration: {first - self.start:.4f}s",
            f"prompt eval rate:     {_rate(prompt, first - self.start)}",
            f"eval count:           {gen} token(s){note}",
            f"eval duration:        {last - first:.4f}s",
            f"eval rate:            {_rate(gen, last - first)}",
        ]


def _rate(count: int, seconds: float) -> str:
    return f"{count / seconds:.2f} tokens/s" if seconds > 0 and count else "n/a"


def _remote_stream(args, messages: list[dict], stats: ReplyStats) -> Iterator[str]:
    import httpx  # here, not at the top: `hetserve --help` imports every command module

    key = args.api_key or envs.api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": args.temperature,
    }
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    if args.model:  # the served model or one of its LoRA adapters
        body["model"] = args.model
    url = _base(args.url) + "/v1/chat/completions"
    chunks, usage = 0, None
    try:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=None) as r:
            if r.status_code != 200:
                r.read()
                if r.status_code == 400 and "context" in r.text:  # the session goes on
                    raise ContextFull(f"the server answered: {_message(r)}")
                raise InvalidInputError(f"server answered {r.status_code}: {r.text[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                for choice in event.get("choices", []):
                    piece = choice.get("delta", {}).get("content") or ""
                    if piece:
                        stats.seen(time.perf_counter())
                        chunks += 1
                    yield piece
    except httpx.HTTPError as exc:
        msg = f"cannot reach {args.url}: {exc}; is the server running?"
        raise InvalidInputError(msg) from None
    if usage:
        stats.prompt_tokens = usage.get("prompt_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        stats.cached_tokens = details.get("cached_tokens") or 0
        stats.completion_tokens = usage.get("completion_tokens", 0)
    else:
        stats.completion_tokens, stats.counted_from_stream = chunks, True


def _local_stream(engine, args, messages: list[dict], stats: ReplyStats) -> Iterator[str]:
    from hetserve import SamplingParams
    from hetserve.core.request import NewRequest

    prompt = engine.tokenizer.apply_chat_template(messages)
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    room = engine.max_model_len - len(ids)
    if room < 1:
        raise ContextFull("the conversation no longer fits the context")
    limit = room if args.max_tokens is None else min(args.max_tokens, room)
    params = SamplingParams(max_tokens=limit, temperature=args.temperature)
    rid = f"chat-{len(messages)}"
    engine.submit(NewRequest(rid, ids, params, lora=args.lora_name))
    sent, tokens = 0, 0
    try:
        while engine.has_unfinished():
            for out in engine.step():
                now = time.perf_counter()
                if len(out.outputs[0].token_ids) > tokens:
                    tokens = len(out.outputs[0].token_ids)
                    stats.seen(now)
                stats.prompt_tokens = len(out.prompt_token_ids)
                stats.cached_tokens = out.num_cached_tokens
                stats.completion_tokens = tokens
                text = out.outputs[0].text
                yield text[sent:]
                sent = len(text)
    finally:  # a reply stopped part way (Ctrl-C) frees its KV blocks
        engine.abort_request(rid)


def register(sub) -> None:
    c = sub.add_parser("chat", help="terminal chat with a model or a running server")
    add_engine_args(c)
    c.add_argument(
        "--url",
        default=None,
        help="a running server, e.g. http://127.0.0.1:8000 (--model NAME then picks the served "
        "model or one of its LoRA adapters)",
    )
    c.add_argument(
        "--lora", default=None, metavar="DIR", help="chat with this LoRA adapter (PEFT directory)"
    )
    c.add_argument("--api-key", default=None)
    c.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="longest reply (default: until the model ends it or the context is full)",
    )
    c.add_argument("--temperature", type=float, default=0.7)
    c.set_defaults(func=chat_loop)


HELP = """commands: /clear forgets the conversation, /system TEXT sets the system prompt
(/system alone clears it), /quit (or Ctrl-D) leaves; arrow keys edit, up/down recall."""
PROMPT = ">>> "


def check_server(args: argparse.Namespace) -> None:
    """Before the first message: is the server there, and does it serve the model asked for?"""
    import httpx

    key = args.api_key or envs.api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = _base(args.url) + "/v1/models"
    try:
        r = httpx.get(url, headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        msg = f"cannot reach {args.url} ({exc}); is the server running?"
        raise InvalidInputError(msg) from None
    if r.status_code != 200:
        raise InvalidInputError(f"{url} answered {r.status_code}: {r.text[:200]}")
    names = [m.get("id") for m in r.json().get("data", [])]
    if args.model and args.model not in names:
        raise InvalidInputError(f"{args.url} serves {names}, not {args.model!r}")


def read_lines() -> Iterator[str]:
    """The user's lines: with a terminal, a prompt with line editing and history (readline,
    kept in the cache directory between sessions); from a pipe, its lines as they are."""
    if not sys.stdin.isatty():
        for line in sys.stdin:
            yield line.rstrip("\n")
        return
    history = envs.cache_dir() / "chat_history"
    try:
        import readline

        history.parent.mkdir(parents=True, exist_ok=True)
        if history.is_file():
            readline.read_history_file(history)
    except (ImportError, OSError):
        readline = None  # type: ignore[assignment]
    try:
        while True:
            try:
                yield input(PROMPT)
            except EOFError:
                print(file=sys.stderr)
                return
    finally:
        if readline is not None:
            try:
                readline.write_history_file(history)
            except OSError:
                pass


def _base(url: str) -> str:
    """The server's root: --url as OpenAI clients take it (ending in /v1) works too."""
    return url.rstrip("/").removesuffix("/v1")


def check_options(args: argparse.Namespace) -> None:
    """The chat's own flags, before a model loads or a server is asked (not at the first
    message)."""
    from hetserve.core.sampling import SamplingParams

    if args.url is not None and not args.url.startswith(("http://", "https://")):
        if "://" in args.url:
            raise InvalidInputError(f"--url {args.url}: use http:// or https://")
        raise InvalidInputError(f"--url {args.url} needs its scheme: http://{args.url}")
    try:
        limit = 1 if args.max_tokens is None else args.max_tokens
        SamplingParams(max_tokens=limit, temperature=args.temperature)
    except ValueError as exc:
        flag = "--max-tokens" if str(exc).startswith("max_tokens") else "--temperature"
        raise InvalidInputError(f"{flag}: {exc}") from None


def chat_loop(args: argparse.Namespace) -> int:
    check_options(args)
    engine = None
    args.lora_name = None
    if args.url is None:
        from hetserve.config import EngineConfig
        from hetserve.engine.core import EngineCore

        if args.lora is not None:
            args.lora_name = Path(args.lora).name or "adapter"
            args.lora_modules = [*(args.lora_modules or ()), f"{args.lora_name}={args.lora}"]
        engine = EngineCore(EngineConfig.from_args(args))
        print(engine.placement_summary, file=sys.stderr)
    elif args.lora is not None:
        raise InvalidInputError(
            "--lora loads an adapter in-process; with --url pick a served adapter by --model NAME"
        )
    else:
        check_server(args)
    messages: list[dict] = []
    system: str | None = None
    print("type a message; /help for commands, /quit or Ctrl-D to leave", file=sys.stderr)
    for line in read_lines():
        if not line.strip():
            continue
        if line.startswith("/"):
            cmd, _, rest = line.partition(" ")
            if cmd in ("/quit", "/exit", "/bye"):
                break
            if cmd == "/clear":
                messages = []
                print("(conversation cleared)", file=sys.stderr)
            elif cmd == "/system":
                system = rest.strip() or None
                print(f"(system prompt {'set' if system else 'cleared'})", file=sys.stderr)
            else:
                if cmd not in ("/help", "/?"):
                    print(f"unknown command {cmd}", file=sys.stderr)
                print(HELP, file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        turn = ([{"role": "system", "content": system}] if system else []) + messages
        stats = ReplyStats(time.perf_counter())
        stream = (
            _remote_stream(args, turn, stats)
            if engine is None
            else _local_stream(engine, args, turn, stats)
        )
        reply: list[str] = []
        try:
            for piece in stream:
                reply.append(piece)
                print(piece, end="", flush=True)
        except ContextFull as exc:  # the session goes on: the user decides what to drop
            messages.pop()
            print(f"({exc}; /clear starts a new conversation)", file=sys.stderr)
            continue
        except KeyboardInterrupt:  # stops the reply, not the chat (Ctrl-C again leaves)
            stream.close()
            print("\n(reply stopped; Ctrl-D or /quit leaves)", file=sys.stderr)
        else:
            print()
            print("\n".join(stats.lines()), flush=True)
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _message(r) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


class ContextFull(InvalidInputError):
    """The conversation's next turn does not fit the model's context."""
