"""The served model's vocabulary, context length and special tokens, as a load generator needs them.

Learned from the server's model card (`/v1/models`: `vocab_size`, `max_model_len`) and from a
tokenizer directory (`config.json`, `tokenizer.json`, `tokenizer_config.json`); explicit command
line values override both. Prompts are then drawn from a `TokenSpace`: ids the model accepts that
are no special token, so a benchmark never sends an id outside the vocabulary or a stray EOS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hetserve.bench.server_info import card_int, model_cards
from hetserve.errors import InvalidInputError

# With no tokenizer to say which ids are special, avoid the lowest ones: small vocabularies put
# pad/bos/eos/unk there (ours: 0-2; Llama: 0-2; GPT-2 style: specials at the end are rare).
FIRST_SAFE_TOKEN_ID = 10


@dataclass(frozen=True)
class TokenizerFacts:
    vocab_size: int | None  # config.json's, else the tokenizer's (added tokens included)
    tokenizer_vocab: int | None  # ids the tokenizer itself knows
    max_position_embeddings: int | None
    special_ids: frozenset[int]


@dataclass(frozen=True)
class ModelFacts:
    vocab_size: int | None  # ids the server accepts are [0, vocab_size)
    max_model_len: int | None  # prompt + output tokens must not exceed this
    special_ids: frozenset[int] | None  # None: unknown (no tokenizer given)
    tokenizer_vocab: int | None = None
    sources: dict[str, str] = field(default_factory=dict)  # fact -> where it came from
    served: tuple[str, ...] = ()  # model ids the server lists

    def token_space(self) -> TokenSpace:
        assert self.vocab_size is not None, "callers check vocab_size first"
        limit = min(self.vocab_size, self.tokenizer_vocab or self.vocab_size)
        return TokenSpace(limit, self.special_ids)

    def notes(self) -> list[str]:
        """One line for the table and the JSON: what the run assumed about the model."""
        said = []
        for key, label in (("vocab_size", "vocabulary"), ("max_model_len", "context")):
            value = getattr(self, key)
            said.append(f"{label} {value} ({self.sources[key]})" if value else f"{label} unknown")
        if self.special_ids is None:
            said.append(f"special tokens unknown: prompt ids avoid 0-{FIRST_SAFE_TOKEN_ID - 1}")
        else:
            said.append(f"{len(self.special_ids)} special token ids avoided")
        return ["model: " + ", ".join(said)]


class TokenSpace:
    """The token ids prompts are drawn from: below `limit`, never one of `avoid`.

    `avoid=None` (special tokens unknown) keeps ids from FIRST_SAFE_TOKEN_ID up, which draws
    exactly what `rng.integers(FIRST_SAFE_TOKEN_ID, limit)` draws, as earlier versions did.
    """

    def __init__(self, limit: int, avoid: frozenset[int] | None = None) -> None:
        if limit < 2:
            raise InvalidInputError(f"vocabulary size must be >= 2, got {limit}")
        if avoid is None:
            self.ids = np.arange(min(FIRST_SAFE_TOKEN_ID, limit - 1), limit, dtype=np.int64)
        else:
            self.ids = np.setdiff1d(np.arange(limit, dtype=np.int64), np.fromiter(avoid, np.int64))
        if not len(self.ids):
            raise InvalidInputError(f"every id below {limit} is a special token; nothing to send")

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self.ids[rng.integers(0, len(self.ids), n)]


def learn_model_facts(
    base_url: str,
    model: str,
    api_key: str | None = None,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
) -> ModelFacts:
    """Merge, in order of precedence: explicit values, the server's card, the tokenizer dir."""
    cards = model_cards(base_url, api_key)
    card = next((c for c in cards if c.get("id") == model), None)
    tok = tokenizer_facts(tokenizer) if tokenizer else None
    sources: dict[str, str] = {}

    def pick(key: str, explicit: int | None, card_key: str, tok_value: int | None) -> int | None:
        for value, source in (
            (explicit, f"--{key.replace('_', '-')}"),
            (card_int(card, card_key), "server /v1/models"),
            (tok_value, f"--tokenizer {tokenizer}"),
        ):
            if value is not None:
                sources[key] = source
                return value
        return None

    return ModelFacts(
        vocab_size=pick("vocab_size", vocab_size, "vocab_size", tok and tok.vocab_size),
        max_model_len=pick(
            "max_model_len", max_model_len, "max_model_len", tok and tok.max_position_embeddings
        ),
        special_ids=tok.special_ids if tok else None,
        tokenizer_vocab=tok.tokenizer_vocab if tok else None,
        sources=sources,
        served=tuple(str(c.get("id")) for c in cards),
    )


def require_vocab(facts: ModelFacts, base_url: str, model: str) -> int:
    """The vocabulary size, or the one-line error that names the fix."""
    if facts.vocab_size is not None:
        return facts.vocab_size
    if facts.served and model not in facts.served:
        raise InvalidInputError(
            f"{base_url} serves {', '.join(map(repr, facts.served))}, not {model!r}; "
            "pass one of those as --model"
        )
    raise InvalidInputError(
        f"{base_url} reports no vocab_size for model {model!r} in /v1/models, so token-id "
        "prompts could fall outside its vocabulary; give --tokenizer DIR (the model's "
        "config.json / tokenizer.json) or --vocab-size N"
    )


def tokenizer_facts(path: str) -> TokenizerFacts:
    """Read a model or tokenizer directory (or a tokenizer.json file)."""
    p = Path(path)
    tok_file = p / "tokenizer.json" if p.is_dir() else p
    config = _read_json(p / "config.json") if p.is_dir() else {}
    if not tok_file.is_file() and not config:
        raise InvalidInputError(f"--tokenizer: no config.json or tokenizer.json in {path}")
    specials: set[int] = set()
    tokenizer_vocab = None
    if tok_file.is_file():
        doc = _read_json(tok_file)
        specials |= {t["id"] for t in doc.get("added_tokens", []) if t.get("special")}
        tokenizer_vocab = _tokenizer_vocab_size(tok_file)
    if p.is_dir():
        decoder = _read_json(p / "tokenizer_config.json").get("added_tokens_decoder", {})
        specials |= {int(i) for i, t in decoder.items() if t.get("special")}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = config.get(key)
        specials |= {i for i in (ids if isinstance(ids, list) else [ids]) if isinstance(i, int)}
    vocab = config.get("vocab_size")
    ctx = config.get("max_position_embeddings")
    return TokenizerFacts(
        vocab_size=vocab if isinstance(vocab, int) else tokenizer_vocab,
        tokenizer_vocab=tokenizer_vocab,
        max_position_embeddings=ctx if isinstance(ctx, int) else None,
        special_ids=frozenset(specials),
    )


def _tokenizer_vocab_size(path: Path) -> int:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as exc:  # the tokenizers library raises its own untyped errors
        raise InvalidInputError(f"--tokenizer: cannot load {path} ({exc})") from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"--tokenizer: {path} is not readable JSON ({exc})") from None
    return doc if isinstance(doc, dict) else {}
