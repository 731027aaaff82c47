"""Ollama's API beside OpenAI's, for Open WebUI, desktop apps and the `ollama` client:
/api/chat, /api/generate (NDJSON streams by default), /api/tags, /api/show, /api/ps,
/api/version; /api/embed answers that no embedding model is served.

Each request is translated into the OpenAI chat request it means (ollama_input.py) and run
by the chat route's machinery, so tools, `format` (JSON or a schema: structured output) and
`think` (reasoning) work as they do there. `options` map to sampling (num_predict,
temperature, top_k, top_p, min_p, stop, seed, repeat_penalty, presence/frequency_penalty);
num_ctx and keep_alive are accepted (the engine's context and residency are fixed at start)
and other options ignored, as Ollama ignores the ones a runner does not use. /api/generate's
`raw` prompt is sent as written, and with a `suffix` the model's own fill-in-the-middle tokens
frame it (Ollama's insert; a model without them says it does not support insert). The load and
unload calls (no messages, no prompt) answer done, as Ollama's do. The model is listed as
NAME:latest and answers to it; replies name it as the request did. Errors are Ollama's
{"error": "..."} with the field named in the message and the 4xx status.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hetserve.errors import InvalidInputError
from hetserve.server.chat import ChatServing
from hetserve.server.completions import NO_FIM
from hetserve.server.ollama_input import (
    check_fields,
    generate_messages,
    keep_alive_seconds,
    no_images,
    openai_messages,
    openai_request,
    typed,
)
from hetserve.server.stream_merge import merge
from hetserve.server.tools import Parsed, Streamer
from hetserve.server.tools.registry import output_parser
from hetserve.server.validation import json_object

OLLAMA_VERSION = "0.12.11"  # the API version whose fields we serve (clients check it)
LATEST = ":latest"  # Ollama's default tag: NAME:latest names the model served as NAME
SENT_MODEL = "_model_as_sent"  # set on every body (the client's own value overwritten)


def ollama_name(name: str) -> str:
    """`name` as Ollama lists a model: with its tag, the default ":latest" when it has none."""
    return name if ":" in name.rsplit("/", 1)[-1] else name + LATEST


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _ollama_calls(parsed: Parsed) -> list[dict]:
    calls = []
    for c in parsed.calls:
        try:
            args = json.loads(c.arguments or "{}")
        except ValueError:
            args = c.arguments
        calls.append({"function": {"name": c.name, "arguments": args}})
    return calls


class OllamaServing:
    def __init__(self, chat: ChatServing, model_name: str) -> None:
        self.chat = chat
        self.model_name = model_name

    def name_of(self, body: dict) -> str:
        """The model as the request named it ("NAME:latest" stays so), which Ollama's replies
        echo; the served name where the request named none."""
        return body.get(SENT_MODEL) or self.model_name

    async def run(
        self, body: dict, messages: list[dict], request: Request, key: str, text: str | None = None
    ):
        """`key`: the reply's field ('message' for /api/chat, 'response' for generate).
        `text`: a prompt sent as it is, no template (generate's raw, or with a suffix the
        fill-in-the-middle prompt the model's FIM tokens make of it). Generate's `context`
        (the ids an earlier answer gave back, deprecated by Ollama but sent by its clients)
        goes in front of the prompt as its text; its answer (not raw) gives the ids of prompt
        and reply back as `context`."""
        base = f"ollama-{int(time.time() * 1e6)}"
        t0, name = time.perf_counter(), self.name_of(body)
        context = body.get("context") if key == "response" else None
        if context:
            if text is None:  # the template's prompt, after the earlier turns' text
                text = await self.chat.prompt_of(openai_request(body, messages))
            text = self.chat.tok.decode(context, skip_special_tokens=False) + text
        if text is None:
            req = openai_request(body, messages)
            streams, parsers, _ = await self.chat.prepare(base, req, request)
        else:
            req = openai_request(body, [{"role": "user", "content": text}])
            streams, parsers = await self._as_written(base, body, text, req, request)
        context_back = key == "response" and not body.get("raw")
        if body.get("stream", True):
            return StreamingResponse(
                self._lines(streams, parsers[0], name, key, t0, context_back, req),
                media_type="application/x-ndjson",
            )

        async def collect():
            last = first = None
            async for _, out in merge(streams):
                first, last = first or time.perf_counter(), out
            out = last
            c = out.outputs[0]
            parsed = parsers[0].parse(c.text, final=True)
            calls = _ollama_calls(parsed)
            reply = self._reply(name, key, parsed.content, parsed.reasoning, calls)
            done = self._done(out, c, t0, first or time.perf_counter(), context_back)
            return {**reply, **done, **self._logprobs(req, c, 0)}

        return await self.chat.run_unless_disconnected(request, streams, collect())

    async def _as_written(self, base: str, body: dict, text: str, req, request: Request):
        stops: tuple[int, ...] = ()
        if body.get("suffix") and not body.get("raw"):  # Ollama's: a raw prompt is as written
            fim = self.chat.tok.fim_prompt(text, body["suffix"])
            if fim is None:
                raise InvalidInputError(f"{self.name_of(body)} does not support insert: "
                                        f"{NO_FIM.split(': ', 1)[1]}", "suffix")  # fmt: skip
            text, stops = fim
        ids = await self.chat.encode(text, add_special_tokens=True)
        limit = req.limit_for(len(ids), self.chat.engine.max_model_len)

        k = (req.top_logprobs or 0) if req.logprobs else None

        def params(_i, _ids):
            return self.chat.sampling_params(req, limit, k, stops=stops)

        streams = self.chat.start(base, [(text, ids)], params, req, request)
        return streams, [output_parser(None, None, None, text)]  # the text, as written

    def _reply(self, name: str, key: str, content: str, thinking: str, calls: list) -> dict:
        """A reply line; `name`: the model as the client named it (Ollama echoes it)."""
        if key == "response":
            out: dict[str, Any] = {"response": content}
            if thinking:
                out["thinking"] = thinking
        else:
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = calls
            out = {"message": msg}
        return {"model": name, "created_at": _now(), **out, "done": False}

    def _done(self, out, c, t0: float, first: float, context: bool = False) -> dict:
        end = time.perf_counter()
        ids = {"context": [*out.prompt_token_ids, *c.token_ids]} if context else {}
        return {
            **ids,
            "done": True,
            "done_reason": c.finish_reason if c.finish_reason != "abort" else "stop",
            "total_duration": int((end - t0) * 1e9),
            "load_duration": 0,
            "prompt_eval_count": len(out.prompt_token_ids),
            "prompt_eval_duration": int((first - t0) * 1e9),
            "eval_count": len(c.token_ids),
            "eval_duration": int((end - first) * 1e9),
        }

    def _logprobs(self, req, c, seen: int) -> dict:
        """Ollama's `logprobs` of the tokens after the first `seen` (none unless asked)."""
        if not req.logprobs:
            return {}
        entries = c.logprobs[seen:] if c.logprobs else []
        lp = self.chat.token_logprobs(c.token_ids[seen:], entries, req.top_logprobs or 0)
        return {"logprobs": lp["content"]}

    async def _lines(self, streams, parser, name: str, key: str, t0: float, context: bool,
                     req) -> AsyncIterator[str]:  # fmt: skip
        streamer = Streamer(parser)
        out = first = None
        seen = 0  # tokens whose logprobs a line has carried
        try:
            async for _, out in merge(streams):
                first = first or time.perf_counter()
                c = out.outputs[0]
                content, thinking, _ = streamer.feed(c.text, final=c.finish_reason is not None)
                if content or thinking:
                    lp = self._logprobs(req, c, seen)
                    seen = len(c.token_ids)
                    yield _line({**self._reply(name, key, content, thinking, []), **lp})
            if out is None:
                return
            c = out.outputs[0]
            calls = _ollama_calls(streamer.sent)  # whole calls, as Ollama streams them
            final = self._reply(name, key, "", "", calls)
            done = self._done(out, c, t0, first or time.perf_counter(), context)
            yield _line({**final, **done, **self._logprobs(req, c, seen)})
        except Exception as exc:  # a stream ends with an error line, as Ollama's do
            yield _line({"error": str(exc)})
        finally:
            for s in streams:
                s.abort()


def _line(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":")) + "\n"


def _family(engine) -> str:
    try:
        cfg = json.loads((engine.model_dir / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return ""
    return str(cfg.get("model_type", ""))


def install_ollama_routes(app: FastAPI, serving: OllamaServing, engine, check_model) -> None:
    name = serving.model_name
    family = _family(engine)

    def details() -> dict:
        return {"format": "safetensors", "family": family, "families": [family]}

    def card() -> dict:  # listed as clients send it back ("NAME:latest")
        return {
            "name": ollama_name(name),
            "model": ollama_name(name),
            "modified_at": _now(),
            "size": 0,
            "digest": "",
            "details": details(),
        }

    def loaded(body: dict, key: str) -> dict:
        """Ollama's answer to a call with nothing to generate: it loads the model, or unloads it
        with keep_alive 0 (here the model stays resident, served from start to stop)."""
        reason = "unload" if keep_alive_seconds(body.get("keep_alive")) == 0 else "load"
        reply = serving._reply(serving.name_of(body), key, "", "", [])
        return {**reply, "done": True, "done_reason": reason}

    async def body_of(request: Request) -> dict:
        body = await json_object(request)
        model = typed(body.get("model"), (str,), "model", "a string")
        if not model:
            raise InvalidInputError("model is required", "model")  # as Ollama answers
        missing = check_model(model)
        bare = model.removesuffix(LATEST) if model else model
        if missing is not None and bare != model and check_model(bare) is None:
            body["model"], missing = bare, None
        body[SENT_MODEL] = model
        if missing is not None:
            return {"_missing": missing}
        return body

    @app.get("/api/version")
    async def version():
        return {"version": OLLAMA_VERSION}

    @app.get("/api/tags")
    async def tags():
        return {"models": [card()]}

    @app.get("/api/ps")
    async def ps():
        return {"models": [{**card(), "expires_at": "2999-01-01T00:00:00Z", "size_vram": 0}]}

    @app.post("/api/show")
    async def show(request: Request):
        body = await body_of(request)
        if "_missing" in body:
            return _not_found(body)
        tok = serving.chat.tok
        caps = ["completion"]
        if serving.chat.tool_parser:
            caps.append("tools")
        if serving.chat.reasoning_parser:
            caps.append("thinking")
        return {
            "modelfile": "",
            "parameters": "",
            "template": tok.chat_template or "",
            "details": details(),
            # clients size their context from "<arch>.context_length"
            "model_info": {"general.architecture": family,
                           f"{family}.context_length": engine.max_model_len},  # fmt: skip
            "capabilities": caps,
        }

    @app.post("/api/chat")
    async def chat(request: Request):
        body = await body_of(request)
        if "_missing" in body:
            return _not_found(body)
        check_fields(body)
        messages = typed(body.get("messages"), (list,), "messages", "a list")
        if not messages:  # Ollama's way to load (or unload) a model
            return loaded(body, "message")
        return await serving.run(body, openai_messages(messages), request, "message")

    @app.post("/api/generate")
    async def generate(request: Request):
        body = await body_of(request)
        if "_missing" in body:
            return _not_found(body)
        check_fields(body)
        prompt = typed(body.get("prompt"), (str,), "prompt", "a string") or ""
        system = typed(body.get("system"), (str,), "system", "a string")
        raw = typed(body.get("raw"), (bool,), "raw", "true or false")
        typed(body.get("suffix"), (str,), "suffix", "a string")
        no_images(body.get("images"), "images")
        context = typed(body.get("context"), (list,), "context", "a list of token ids")
        vocab = engine.engine.vocab_size
        if context and not all(type(t) is int and 0 <= t < vocab for t in context):
            raise InvalidInputError(f"context must hold token ids below {vocab}", "context")
        if context and body.get("suffix"):
            raise InvalidInputError("context does not go with suffix (insert)", "context")
        if not prompt:  # Ollama's way to load (or unload) a model
            return loaded(body, "response")
        if raw or body.get("suffix"):  # as written (raw), or filled in the middle (insert)
            return await serving.run(body, [], request, "response", text=prompt)
        return await serving.run(body, generate_messages(system, prompt), request, "response")

    @app.post("/api/embed")
    @app.post("/api/embeddings")
    async def embed():
        return JSONResponse({"error": f"{name} is not an embedding model"}, status_code=400)


def ollama_error(body: dict) -> dict:
    """An OpenAI-shaped error body in Ollama's shape (the P/D Conductor's own answers)."""
    return {"error": body["error"]["message"]}


def ollama_stream_error(message: str) -> bytes:
    """An Ollama stream's last line where the instance serving it fails mid-way."""
    return (json.dumps({"error": message}) + "\n").encode()


def _not_found(body: dict) -> JSONResponse:
    """The model check's answer (a 404, or a 400 for a malformed name) in Ollama's shape."""
    missing = body["_missing"]
    err = json.loads(missing.body)["error"]["message"]
    return JSONResponse({"error": err}, status_code=missing.status_code)
