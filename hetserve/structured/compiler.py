"""GrammarCompiler: GrammarSpec -> llguidance grammar, checked once and cached by content.

llguidance compiles lazily (its lexer and Earley parser build states as tokens come), so a
compile is about a millisecond for typical schemas (xgrammar took 45 ms to 2 s for the same
ones here: docs/structured-output.md); what costs is the tokenizer view (~1 s for a 128k
vocabulary), built once on a background thread at start-up so no request waits for it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from hetserve.core.grammar import GrammarKind, GrammarSpec
from hetserve.errors import InvalidInputError
from hetserve.model.tokenizer import Tokenizer

CACHE_ENTRIES = 512  # compiled grammars kept (an agent sends the same few schemas again)
# Compact separators with no free whitespace: models write JSON this way, and a model that
# is unsure (or random) cannot then spend its whole budget on spaces and newlines.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
MAX_GRAMMAR_CHARS = 1 << 20


class GrammarMatcher:
    """One sequence's place in its grammar. Used on the engine thread (and its mask worker,
    never at the same time: the executor waits for the mask before it accepts a token)."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.ll = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar refuses it (or is done)."""
        if self.ll.is_stopped():
            return True  # done: the mask allows only end-of-sequence, nothing more to check
        return bool(self.ll.consume_token(token_id)) and not self.ll.is_error()

    @property
    def error(self) -> str:
        return self.ll.get_error()

    @property
    def done(self) -> bool:
        return bool(self.ll.is_stopped())


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._eos = sorted(eos_ids)
        self._ll_tok: llguidance.LLTokenizer | None = None
        self._tok_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, bool], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # cache misses, for tests and metrics
        threading.Thread(target=self.ll_tokenizer, name="grammar-tokenizer", daemon=True).start()

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (built once; ~1 s for 128k tokens)."""
        with self._tok_lock:
            if self._ll_tok is None:
                self._ll_tok = _ll_tokenizer(self._tokenizer, self.vocab_size, self._eos)
            return self._ll_tok

    def check(self, spec: GrammarSpec) -> None:
        """Compile `spec` (or find it cached); InvalidInputError naming its field if it
        cannot be."""
        self._template(spec)

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher at the start of `spec`'s grammar."""
        return GrammarMatcher(self._template(spec).deep_copy())

    def _template(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        with self._lock:
            found = self._cache.get(spec.key)
            if found is not None:
                self._cache.move_to_end(spec.key)
                return found
        grammar = to_llguidance(spec)
        # The matcher drops the GIL while it builds; errors leave it in an error state.
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidInputError(_explain(spec, matcher.get_error()), param=spec.param)
        with self._lock:
            self.compiles += 1
            self._cache[spec.key] = matcher
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return matcher


def to_llguidance(spec: GrammarSpec) -> str:
    """The llguidance grammar text of a spec; InvalidInputError naming the field if the spec
    itself is malformed (not JSON, not a list of strings, ...)."""
    src, param = spec.source, spec.param
    if len(src) > MAX_GRAMMAR_CHARS:
        raise InvalidInputError(f"{param} is over {MAX_GRAMMAR_CHARS} characters", param)
    try:
        if spec.kind is GrammarKind.JSON_OBJECT:
            return _json({"type": "object"}, strict=True)
        if spec.kind is GrammarKind.JSON_SCHEMA:
            schema = json.loads(src)
            if not isinstance(schema, dict):
                raise InvalidInputError(f"{param}: a JSON schema must be an object", param)
            return _json(schema, spec.strict)
        if spec.kind is GrammarKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(src)
        if spec.kind is GrammarKind.CHOICE:
            choices = json.loads(src)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise InvalidInputError(f"{param} must be a non-empty list of strings", param)
            body = " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
            return llguidance.LLMatcher.grammar_from_lark(f"start: {body}\n")
        if "::=" in src:  # GBNF (llama.cpp's, which vLLM's guided_grammar also takes)
            src = gbnf_to_lark(src)
        return llguidance.LLMatcher.grammar_from_lark(src)
    except InvalidInputError:
        raise
    except Exception as exc:  # the libraries' parse errors: the client's grammar is wrong
        raise InvalidInputError(_explain(spec, str(exc)), param) from None


def _json(schema: dict, strict: bool) -> str:
    # Not strict (OpenAI's strict: false): keywords llguidance does not implement are ignored
    # instead of refused.
    options = {**JSON_OPTIONS, "lenient": not strict}
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)


def _explain(spec: GrammarSpec, error: str) -> str:
    # One line: the libraries' first, and where it only introduces the cause on a later line
    # under the source and a caret ("regex parse error:" ... "error: unclosed group"), that.
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    first = lines[0] if lines else "unknown error"
    if first.endswith(":"):
        cause = next((x for x in lines[1:] if x.lower().startswith("error:")), None)
        first += " " + (cause[len("error:") :].strip() if cause else " ".join(lines[1:2]))
    what = {
        GrammarKind.JSON_SCHEMA: "JSON schema",
        GrammarKind.JSON_OBJECT: "JSON object grammar",
        GrammarKind.REGEX: "regular expression",
        GrammarKind.CHOICE: "choice",
        GrammarKind.LARK: "grammar",
    }[spec.kind]
    return f"{spec.param}: the {what} cannot be compiled: {first[:300]}"


class _Vocabulary:
    """The vocabulary as llguidance's TokenizerWrapper reads it: each token's bytes, which
    ids are special, and an encoder. Built from our Tokenizer rather than from tokenizer.json,
    where llguidance takes every added token for a special one: a format's markers
    (<think>, <tool_call>) are added but not special, and a grammar must be able to write
    them (llguidance's mask allowed them while its matcher refused them)."""

    def __init__(self, tok: Tokenizer, vocab_size: int, eos: list[int]) -> None:
        self.eos_token_id = eos[0] if eos else 0
        self.bos_token_id = None
        self.tokens = [tok.token_bytes(i) for i in range(vocab_size)]
        self.special_token_ids = [i for i in tok.special_ids() if i < vocab_size]
        self._tok = tok

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special_tokens=False)


def _ll_tokenizer(tok: Tokenizer, vocab_size: int, eos: list[int]) -> llguidance.LLTokenizer:
    wrapper = llguidance.TokenizerWrapper(_Vocabulary(tok, vocab_size, eos))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos or None)
