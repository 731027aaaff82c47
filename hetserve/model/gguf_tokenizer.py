"""The tokenizer a GGUF file describes in its metadata, as a `tokenizers` Tokenizer.

Who calls it: model/tokenizer.py, for a .gguf model with no tokenizer.json beside it. Two of
llama.cpp's vocabulary kinds (`tokenizer.ggml.model`):

- "gpt2": byte-level BPE from `tokens` and `merges`, split first by the pre-tokenizer
  `tokenizer.ggml.pre` names (gpt-2 / default, qwen2);
- "llama": SentencePiece from `tokens`, `scores` and `token_type` (llama.cpp's converter
  writes them from the tokenizer.model: 1 normal, 2 unknown, 3 control, 4 user-defined,
  5 unused, 6 byte). llama.cpp tokenizes it by merging, again and again, the adjacent pair
  whose joined piece is in the vocabulary with the highest score, falling back to the
  <0xXX> byte pieces for characters that are not; that is BPE whose merges rank by the
  joined piece's score, which is what is built here (as transformers converts a
  SentencePiece BPE model), with the "▁" space escape and prefix (`add_space_prefix`, on
  unless the file says otherwise) and BOS / EOS added as `add_bos_token` / `add_eos_token` say
  (llama.cpp's defaults for this kind: BOS yes, EOS no).

Failure: any other kind or pre-tokenizer is a ModelLoadError (one line) asking for a
tokenizer.json beside the file.
"""

from __future__ import annotations

from typing import Any

from hetserve.errors import ModelLoadError

# Byte-level BPE pre-tokenizers by `tokenizer.ggml.pre` (the split before BPE merges).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("gpt-2", "default", "qwen2")
KINDS = ("gpt2", "llama")
_NORMAL, _UNKNOWN, _CONTROL, _USER, _BYTE = 1, 2, 3, 4, 6
_SPACE = "\u2581"  # SentencePiece's escaped space


def gguf_tokenizer(ckpt: Any) -> Any:
    """The `tokenizers` Tokenizer of `ckpt` (a GgufCheckpoint)'s metadata."""
    kind, pre = ckpt.field("tokenizer.ggml.model"), ckpt.field("tokenizer.ggml.pre", "default")
    if kind == "llama":
        return _sentencepiece(ckpt)
    if kind != "gpt2" or pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"GGUF tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported (supported: "
            f"llama, and gpt2 with {', '.join(PRE_TOKENIZERS)}); put a tokenizer.json beside "
            "the file"
        )
    return _byte_level_bpe(ckpt, pre)


def _byte_level_bpe(ckpt: Any, pre: str) -> Any:
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    tokens = ckpt.field("tokenizer.ggml.tokens")
    vocab = {t: i for i, t in enumerate(tokens) if t}
    merges = [tuple(m.split(" ", 1)) for m in ckpt.field("tokenizer.ggml.merges", [])]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre != "qwen2")
    if pre == "qwen2":
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    _add_special(tok, tokens, ckpt.field("tokenizer.ggml.token_type", [1] * len(tokens)))
    return tok


def _add_special(tok: Any, tokens: list[str], types: list[int]) -> None:
    """Control and user-defined tokens: matched whole, never split or merged into."""
    from tokenizers import AddedToken

    special = [t for t, ty in zip(tokens, types, strict=True) if t and ty in (_CONTROL, _USER)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama.cpp's SentencePiece merging: every split of a normal
    piece into two pieces of the vocabulary, ranked by the joined piece's score (highest
    first; ties in vocabulary order, as transformers' SentencePiece extractor ranks them)."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] in (_NORMAL, _UNKNOWN)}
    ranked = []
    for piece, i in ids.items():
        if types[i] != _NORMAL:
            continue
        pairs = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        pairs = sorted((p for p in pairs if p[0] in ids and p[1] in ids),
                       key=lambda p: (ids[p[0]], ids[p[1]]))  # fmt: skip
        ranked.extend((-scores[i], len(ranked) + j, p) for j, p in enumerate(pairs))
    return [p for _, _, p in sorted(ranked)]


def _sentencepiece(ckpt: Any) -> Any:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, processors

    tokens = ckpt.field("tokenizer.ggml.tokens")
    scores = ckpt.field("tokenizer.ggml.scores")
    types = ckpt.field("tokenizer.ggml.token_type")
    if scores is None or types is None or not len(scores) == len(types) == len(tokens):
        raise ModelLoadError(
            "GGUF tokenizer 'llama' needs tokenizer.ggml.scores and tokenizer.ggml.token_type "
            "beside its tokens, one per token; put a tokenizer.json beside the file"
        )
    unk = next((t for t, ty in zip(tokens, types, strict=True) if ty == _UNKNOWN), None)
    model = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=spm_merges(tokens, scores, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=_BYTE in types,
    )
    tok = HFTokenizer(model)
    prefix = bool(ckpt.field("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(_SPACE)] if prefix else []
    # the prefix before every stretch of text, also after a control or user-defined token in
    # it: llama.cpp's rule (its SentencePiece tokenizer sees each stretch on its own)
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    undo = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(undo + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    _add_special(tok, tokens, types)
    ends = []
    for key, default in (("bos", True), ("eos", False)):
        token_id = ckpt.field(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and ckpt.field(f"tokenizer.ggml.add_{key}_token", default):
            ends.append((tokens[token_id], token_id))
    if ends:
        first = [t for t, i in ends if i == ckpt.field("tokenizer.ggml.bos_token_id")]
        last = [t for t, _ in ends if t not in first]
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join([*first, "$A", *last]),
            pair=" ".join([*first, "$A", *last, "$B:1", *last]),
            special_tokens=ends,
        )
    return tok
