"""Tokenizer from tokenizer.json (the `tokenizers` library) or Kimi's tiktoken.model
(model/tiktoken_tokenizer.py), and chat templates rendered with jinja2.

transformers is not needed at run time: special tokens come from tokenizer_config.json, the chat
template from tokenizer_config.json or chat_template.jinja, EOS ids also from
generation_config.json.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from hetserve.errors import InvalidInputError, ModelLoadError, ModelNotFoundError
from hetserve.model.tiktoken_tokenizer import _CHAR_BYTES, TIKTOKEN_FILE, TiktokenBPE


def _token_str(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        return value.get("content")
    return value


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc.msg}); fix or remove it") from None


class Tokenizer:
    """From a model directory (tokenizer.json and its configs), or a GGUF file: the files beside
    it where there is a tokenizer.json, else the tokenizer inside the file."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        if model_dir.suffix == ".gguf" and model_dir.is_file():
            if not (model_dir.parent / "tokenizer.json").is_file():
                self._from_gguf(model_dir)
                return
            model_dir = model_dir.parent
        if not model_dir.is_dir():
            raise ModelNotFoundError(
                f"model directory {str(model_dir)!r} does not exist; give a local HF model "
                "directory (or a .gguf file)"
            )
        path = model_dir / "tokenizer.json"
        cfg = _read_json(model_dir / "tokenizer_config.json")
        if path.is_file():
            self._tok = HFTokenizer.from_file(str(path))
        elif (model_dir / TIKTOKEN_FILE).is_file():  # Kimi's format
            self._tok = TiktokenBPE.from_dir(model_dir, cfg)
        else:
            raise ModelLoadError(
                f"{str(model_dir)!r} has no tokenizer.json; add one (fast tokenizer format)"
            )
        gen = _read_json(model_dir / "generation_config.json")
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.pad_token = _token_str(cfg.get("pad_token"))
        template = cfg.get("chat_template")
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        self._finish(template, gen.get("eos_token_id"))

    def _from_gguf(self, path: Path) -> None:
        from hetserve.model.gguf_file import GgufCheckpoint
        from hetserve.model.gguf_tokenizer import gguf_tokenizer

        ckpt = GgufCheckpoint(path)
        self._tok = gguf_tokenizer(ckpt)
        ids = {k: ckpt.field(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
        self.bos_token, self.eos_token, self.pad_token = (
            None if i is None else self._tok.id_to_token(i) for i in ids.values()
        )
        self._finish(ckpt.field("tokenizer.chat_template"), ids["eos"])

    def _finish(self, template: str | None, eos_ids) -> None:
        self.chat_template: str | None = template
        eos_ids = eos_ids if isinstance(eos_ids, list) else [] if eos_ids is None else [eos_ids]
        if self.eos_token is not None and self.token_to_id(self.eos_token) is not None:
            eos_ids.append(self.token_to_id(self.eos_token))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        self._template = None

    @property
    def backend(self) -> HFTokenizer | TiktokenBPE:
        """The library tokenizer underneath (the grammar engine builds its own view of it)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_long(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode` for long texts, meant for a worker thread: `encode_batch` releases the GIL
        while it works (plain `encode` holds it throughout), so the server's event loop keeps
        answering meanwhile."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest token string. Byte-level and metaspace vocabularies spell
        each token with at least one character per character of text it covers, so a text of
        C characters has at least C / max_token_chars tokens: a bound checked before
        tokenizing a text that cannot fit the context anyway."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    @functools.cached_property
    def _byte_level(self) -> bool:
        tok = self._tok
        return isinstance(tok, TiktokenBPE) or isinstance(tok.decoder, decoders.ByteLevel)

    def special_ids(self) -> list[int]:
        """Ids of the special tokens (those decoding with skip_special_tokens drops)."""
        tok = self._tok
        if isinstance(tok, TiktokenBPE):
            return tok.special_ids()
        return sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token (OpenAI's logprobs `bytes`): a token that holds part of a
        UTF-8 character has those bytes, not the replacement character decoding gives."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in _CHAR_BYTES for c in piece):
            return bytes(_CHAR_BYTES[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self.decode([token_id], skip_special_tokens=False).encode()

    def fim_markers(self) -> tuple[str, str, str] | None:
        """The fill-in-the-middle markers (prefix, suffix, middle) this vocabulary has as
        tokens (FIM_MARKERS), None where it has none (not a code model)."""
        for markers in FIM_MARKERS:
            if all(self.token_to_id(m) is not None for m in markers):
                return markers
        return None

    def fim_prompt(self, prefix: str, suffix: str) -> tuple[str, tuple[int, ...]] | None:
        """The fill-in-the-middle prompt (prefix, suffix, middle markers) and the markers'
        ids, which end the middle where the model writes one; None without FIM tokens."""
        markers = self.fim_markers()
        if markers is None:
            return None
        pre, suf, mid = markers
        ends = (*markers, *FIM_ENDS)  # a marker or the start of another file ends the middle
        ids = tuple(t for t in (self.token_to_id(m) for m in ends) if t is not None)
        return f"{pre}{prefix}{suf}{suffix}{mid}", ids

    def bad_word_ids(self, words: Iterable[str]) -> tuple[tuple[int, ...], ...]:
        """Words (vLLM's bad_words) as the token sequences that spell them: alone and after a
        space (mid-sentence, where byte-level BPEs spell a word otherwise), without repeats."""
        out: dict[tuple[int, ...], None] = {}
        for word in words:
            for spelled in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.encode(spelled, add_special_tokens=False))
                if ids:
                    out[ids] = None
        return tuple(out)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **extra,
    ) -> str:
        """The conversation as the model's template renders it (`chat_template`: as this one
        renders it instead, in the same sandbox). `continue_final_message`: the
        text cut right after the final message's, so the reply continues that message instead
        of closing it (transformers' rendering: its trailing whitespace kept where the
        template keeps a message's text as it is, dropped where the template trims it); a
        template that does not render the text as given is an InvalidInputError."""
        if chat_template is not None:
            template = _given_template(chat_template)
        elif not self.chat_template:
            raise InvalidInputError(
                "this model has no chat template; use a completion prompt or add "
                "'chat_template' to tokenizer_config.json"
            )
        else:
            if self._template is None:
                self._template = _environment().from_string(self.chat_template)
            template = self._template
        if continue_final_message:
            messages = _marked(messages)
        try:
            text: str = template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except jinja2.TemplateError as exc:
            raise InvalidInputError(f"chat template failed on these messages: {exc}") from None
        except Exception as exc:  # a request's own template: its mistake, not the server's
            if chat_template is None:
                raise
            raise InvalidInputError(
                f"chat_template failed: {type(exc).__name__}: {exc}", "chat_template"
            ) from None
        if not continue_final_message:
            return text
        at = text.rfind(_CONTINUE)
        if at < 0:
            raise InvalidInputError(
                "continue_final_message: the chat template did not render the final message's "
                "text as it is, so the reply cannot continue it",
                "continue_final_message",
            )
        if text.startswith(_CONTINUE + " ", at):  # the template keeps the text as it is
            return text[:at]
        return text[:at].rstrip()  # it trims a message's end: as it would have trimmed this one


# Fill-in-the-middle markers as code models' tokenizers spell them: (prefix, suffix, middle).
# A prompt is built prefix-suffix-middle, which all of them were trained on.
FIM_MARKERS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder (V2: MoE)
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, and models trained as it
)

# Tokens that end a fill in the middle beside the markers (llama.cpp stops at them too):
# padding, and what starts another file or repository in the models' training layout.
FIM_ENDS = ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<fim_pad>", "<file_sep>",
            "<reponame>")  # fmt: skip

# Put after the final message's text (with a space, to see whether the template trims it) to
# find where that text ends once rendered.
_CONTINUE = "<hetserve:continue-here>"


def _marked(messages: list[dict]) -> list[dict]:
    """The conversation with the mark after the final message's (last) text."""
    if not messages:
        raise InvalidInputError("continue_final_message needs a message to continue")
    last = dict(messages[-1])
    content = last.get("content")
    if isinstance(content, str):
        last["content"] = content + _CONTINUE + " "
    elif isinstance(content, list | tuple) and any(
        isinstance(p, dict) and "text" in p for p in content
    ):
        parts = [dict(p) if isinstance(p, dict) else p for p in content]
        i = max(i for i, p in enumerate(parts) if isinstance(p, dict) and "text" in p)
        parts[i]["text"] = str(parts[i]["text"]) + _CONTINUE + " "
        last["content"] = parts
    else:
        raise InvalidInputError("continue_final_message needs a final message with text")
    return [*messages[:-1], last]


def _raise(message: str):
    raise jinja2.TemplateError(message)


@functools.lru_cache(maxsize=16)
def _given_template(source: str) -> jinja2.Template:
    """A request's own chat template, compiled once (the few a client sends are reused)."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidInputError(
            f"chat_template is not a valid Jinja template: {exc.message} (line {exc.lineno})",
            "chat_template",
        ) from None


def _environment() -> ImmutableSandboxedEnvironment:
    # Sandboxed: templates ship with model directories and are not trusted code.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
