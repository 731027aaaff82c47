"""tiktoken-format tokenizers as Moonshot publishes them (Kimi-K2, Kimi-K2.5, Moonlight).

Such a model directory has no tokenizer.json. It ships `tiktoken.model` (the BPE ranks, one
"base64(token) rank" line each), `tokenizer_config.json` (`added_tokens_decoder`, bos/eos, chat
template; `tokenizer_class` TikTokenTokenizer, `auto_map` -> tokenization_kimi.py) and
`tokenization_kimi.py`, which holds the split pattern. We never run that file: the pattern is
below, the special-token layout is read from tokenizer_config.json, and tiktoken itself (the
implementation the model was trained with) encodes and decodes, so there is no download and no
trust_remote_code.

`TiktokenBPE` duck-types the part of `tokenizers.Tokenizer` that `model/tokenizer.py` uses.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from hetserve.errors import ModelLoadError

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CLASS = "TikTokenTokenizer"

# Kimi's split pattern (`pat_str` of tokenization_kimi.py, fancy-regex syntax, `&&` intersects
# classes): runs of Han characters stand apart from other letters; words with an optional
# leading non-letter and English contractions; numbers in groups of up to three; punctuation
# runs; newlines; other whitespace.
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_LEAD = r"[^\r\n\p{L}\p{N}]?"
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        f"{_LEAD}{_UPPER}*{_LOWER}+{_CONTRACTIONS}",
        f"{_LEAD}{_UPPER}+{_LOWER}*{_CONTRACTIONS}",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
# Special ids follow the ranks: 256 reserved plus 2, named by added_tokens_decoder where it names
# them and "<|reserved_token_{id}|>" otherwise (Kimi-K2: [BOS] = 163584, ..., [PAD] = 163839).
NUM_SPECIAL_IDS = 256 + 2
# Kimi's tokenizer encodes at most this many characters per tiktoken call, and cuts runs of
# whitespace or of non-whitespace longer than the second bound (tiktoken recurses per run); the
# same cuts keep our ids identical to theirs on such inputs.
_MAX_CHUNK_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
_RUNS = re.compile(r"\s+|\S+")


class Encoded(NamedTuple):
    ids: list[int]


def _byte_level_alphabet() -> list[str]:
    """The printable stand-in of every byte in tokenizer.json vocabularies (GPT-2 byte-level):
    printable Latin-1 bytes stand for themselves, the others for code points from 256 up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


BYTE_LEVEL_CHARS = _byte_level_alphabet()
_CHAR_BYTES = {c: b for b, c in enumerate(BYTE_LEVEL_CHARS)}


def is_kimi_tokenizer(config: dict) -> bool:
    auto = (config.get("auto_map") or {}).get("AutoTokenizer") or []
    names = auto if isinstance(auto, list) else [auto]
    return config.get("tokenizer_class") == TOKENIZER_CLASS or any(
        isinstance(n, str) and n.startswith("tokenization_kimi.") for n in names
    )


def _pieces(text: str) -> Iterator[str]:
    """Kimi's cuts of an input before tiktoken sees it (none below _MAX_RUN_CHARS)."""
    if len(text) <= _MAX_RUN_CHARS:
        yield text
        return
    for start in range(0, len(text), _MAX_CHUNK_CHARS):
        chunk = text[start : start + _MAX_CHUNK_CHARS]
        cut = 0
        for run in _RUNS.finditer(chunk):
            for pos in range(run.start() + _MAX_RUN_CHARS, run.end(), _MAX_RUN_CHARS):
                yield chunk[cut:pos]
                cut = pos
        yield chunk[cut:]


class TiktokenBPE:
    def __init__(self, encoding, specials: dict[str, int], skip_ids: frozenset[int]) -> None:
        self._enc = encoding  # a tiktoken.Encoding
        self._skip = skip_ids
        self._specials = specials
        self._special_names = {i: s for s, i in self._specials.items()}
        self._n_vocab = encoding.n_vocab

    def special_ids(self) -> list[int]:
        return sorted(self._skip)

    @property
    def encoding(self):
        """The tiktoken.Encoding (its ranks, special tokens and split pattern)."""
        return self._enc

    @classmethod
    def from_dir(cls, model_dir: Path, config: dict) -> TiktokenBPE:
        """Build from `model_dir/tiktoken.model` and the tokenizer_config.json dict `config`."""
        if not is_kimi_tokenizer(config):
            raise ModelLoadError(
                f"{str(model_dir)!r} has {TIKTOKEN_FILE} but its tokenizer_config.json does not "
                f"name Kimi's {TOKENIZER_CLASS}, the only tiktoken format hetserve knows the "
                "split pattern of; add a tokenizer.json"
            )
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError:
            raise ModelLoadError(
                f"{str(model_dir)!r} has a tiktoken tokenizer; install tiktoken "
                "(pip install tiktoken==0.14.0)"
            ) from None
        path = model_dir / TIKTOKEN_FILE
        # tiktoken caches files it reads under a key made from the path alone; the content
        # hash makes it re-read a file that changed since.
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        try:
            ranks = load_tiktoken_bpe(str(path), expected_hash=digest)
        except ValueError as exc:
            raise ModelLoadError(f"{path} is not a tiktoken BPE file ({exc})") from None
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise ModelLoadError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once")
        specials, skip = special_tokens(config, len(ranks), model_dir)
        encoding = tiktoken.Encoding(
            name=f"{model_dir.name}/{TIKTOKEN_FILE}",
            pat_str=KIMI_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
        return cls(encoding, specials, skip)

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self._n_vocab if with_added_tokens else self._n_vocab - len(self._specials)

    def encode(self, text: str, add_special_tokens: bool = True) -> Encoded:
        # Special tokens written in the text become their ids, as in Kimi's tokenizer; nothing
        # is prepended (its chat template writes every marker itself).
        ids: list[int] = []
        for piece in _pieces(text):
            ids += self._enc.encode(piece, allowed_special="all")
        return Encoded(ids)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[Encoded]:
        # tiktoken's encoder releases the GIL, as the server's worker-thread tokenizing needs.
        return [self.encode(t, add_special_tokens) for t in texts]

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        """Token strings (byte-level spelling, as tokenizer.json writes them) -> ids."""
        ids = range(self.get_vocab_size(with_added_tokens))
        return {tok: i for i in ids if (tok := self.id_to_token(i)) is not None}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        # Unknown ids decode to nothing (as with tokenizers) instead of raising.
        ids = [i for i in ids if 0 <= i < self._n_vocab]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._skip]
        return self._enc.decode(ids, errors="replace")

    def token_to_id(self, token: str) -> int | None:
        """Special token text, or an ordinary token in tokenizer.json's byte-level spelling."""
        if token in self._specials:
            return self._specials[token]
        try:
            raw = bytes(_CHAR_BYTES[c] for c in token)
            return self._enc.encode_single_token(raw)
        except KeyError:
            return None

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._special_names:
            return self._special_names[token_id]
        if not 0 <= token_id < self._n_vocab:
            return None
        raw = self._enc.decode_single_token_bytes(token_id)
        return "".join(BYTE_LEVEL_CHARS[b] for b in raw)


def special_tokens(config: dict, base: int, model_dir: Path) -> tuple[dict[str, int], frozenset]:
    """(special token text -> id) for ids base .. base + NUM_SPECIAL_IDS - 1, and the ids that
    decoding with skip_special_tokens drops: those added_tokens_decoder marks special (the
    default) and the unnamed reserved ones."""
    named: dict[int, str] = {}
    keep: set[int] = set()
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        token_id = int(key)
        content = entry.get("content") if isinstance(entry, dict) else entry
        if not base <= token_id < base + NUM_SPECIAL_IDS or not isinstance(content, str):
            raise ModelLoadError(
                f"{model_dir}/tokenizer_config.json: added token {key!r} is not a special id of "
                f"this tiktoken layout ({base} to {base + NUM_SPECIAL_IDS - 1} with text)"
            )
        named[token_id] = content
        if isinstance(entry, dict) and entry.get("special") is False:
            keep.add(token_id)
    ids = range(base, base + NUM_SPECIAL_IDS)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in ids}
    if len(specials) != NUM_SPECIAL_IDS:
        raise ModelLoadError(f"{model_dir}/tokenizer_config.json names one special token twice")
    return specials, frozenset(i for i in ids if i not in keep)
