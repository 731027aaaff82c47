"""vLLM's `POST /tokenize` and `POST /detokenize`: the served model's tokenizer over HTTP, for
clients that count or cut tokens before they send (chat UIs sizing a context, RL frameworks
keeping token ids, benchmarks).

Who calls it: `server/app.py` installs the routes. /tokenize takes a completion body (`prompt`,
`add_special_tokens` default true) or a chat body (`messages` rendered by the model's chat
template exactly as /v1/chat/completions renders them: tools, `add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs`; `add_special_tokens` default false) and
answers `count`, `max_model_len`, `tokens` and, with `return_token_strs`, each token's string
as the vocabulary writes it. /detokenize takes `tokens` and answers `prompt`.

Failure contract: a malformed body, a chat body the template or the chat route's checks
refuse, or a token id outside the vocabulary is a 400 naming the field; an unknown model a 404,
as the other routes answer.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from hetserve.errors import InvalidInputError
from hetserve.server.chat import ChatServing
from hetserve.server.protocol import ChatCompletionRequest
from hetserve.server.validation import json_object

# The fields /tokenize reads itself; the rest of a chat body is the chat route's.
_OWN = ("add_special_tokens", "return_token_strs")


def install_tokenize_routes(app: FastAPI, chat: ChatServing, check_model) -> None:
    @app.post("/tokenize", include_in_schema=False)
    async def tokenize(request: Request):
        body = await json_object(request)
        refused = check_model(body.get("model"))
        if refused is not None:
            return refused
        for name in _OWN:
            if not isinstance(body.get(name, False), bool):
                raise InvalidInputError(f"{name} must be a boolean", name)
        if "messages" in body:
            fields = {k: v for k, v in body.items() if k not in _OWN}
            prompt = await chat.prompt_of(ChatCompletionRequest.model_validate(fields))
            special = body.get("add_special_tokens", False)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise InvalidInputError("give 'prompt' (a string) or 'messages'", "prompt")
            special = body.get("add_special_tokens", True)
        ids = await chat.encode(prompt, add_special_tokens=special, whole=True)  # counted
        strs = None
        if body.get("return_token_strs"):
            strs = [chat.tok.id_to_token(t) or chat.token_str(t) for t in ids]
        return {"count": len(ids), "max_model_len": chat.engine.max_model_len, "tokens": ids,
                "token_strs": strs}  # fmt: skip

    @app.post("/detokenize", include_in_schema=False)
    async def detokenize(request: Request):
        body = await json_object(request)
        refused = check_model(body.get("model"))
        if refused is not None:
            return refused
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(_is_id(t) for t in tokens):
            raise InvalidInputError("tokens must be a list of token ids (integers)", "tokens")
        vocab = chat.engine.vocab_size
        for i, t in enumerate(tokens):
            if not 0 <= t < vocab:
                raise InvalidInputError(
                    f"token id {t} is outside the vocabulary (0 to {vocab - 1})", f"tokens.{i}"
                )
        return {"prompt": chat.tok.decode(tokens, skip_special_tokens=False)}


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
