"""A tiny Kimi-K2-format tokenizer directory, trained offline, for tests and `make-tiny`.

Laid out as Moonshot publishes Kimi-K2: `tiktoken.model` (BPE ranks), `tokenizer_config.json`
(added_tokens_decoder with Kimi's ids relative to the end of the ranks, bos/eos/unk/pad, a
chat template in Kimi's <|im_user|>user<|im_middle|>...<|im_end|> format, tokenizer_class and
auto_map naming tokenization_kimi.py) and a `tokenization_kimi.py`. Ours raises on import: it
stands for the remote code that hetserve must never run.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from hetserve.model.tiktoken_tokenizer import (
    BYTE_LEVEL_CHARS,
    KIMI_PATTERN,
    TIKTOKEN_FILE,
    TOKENIZER_CLASS,
)
from hetserve.testing.chat_templates import KIMI
from hetserve.testing.tiny_tokenizer import pseudo_sentences

NUM_RANKS = 400  # 256 single bytes and 144 merges
# Kimi-K2's named special tokens, as offsets from the first special id (163584 there).
KIMI_SPECIAL_OFFSETS = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "[UNK]": 254,
    "[PAD]": 255,
}
# Kimi's vocab_size covers the ranks and 256 special ids (163840 = 163584 + 256); the last two
# of the tokenizer's 258 special ids lie beyond the model's vocabulary.
MODEL_VOCAB_SIZE = NUM_RANKS + 256

CHAT_TEMPLATE = KIMI  # tools, tool calls and results as Kimi-K2's template renders them
REMOTE_CODE_TRIPWIRE = (
    '"""Stands for Kimi\'s tokenization_kimi.py in test directories."""\n\n'
    'raise ImportError("hetserve must read this directory without running its remote code")\n'
)

_WORDS = (
    "the model serves tokens from experts while attention runs on the accelerator; Hello World "
    "it's they're we'll I'd ABC DEF naïve café Zürich señor 你好 世界 模型 专家 注意力 缓存 "
    "東京 こんにちは カタカナ 한국어 Привет мир 😀 🚀 0 7 42 1234 56789 3.14 ( ) [ ] { } <|> "
    "+ - * / = _ . , ; ! ? :: -> == \t \n \r\n"
).split(" ")


def train_ranks() -> dict[bytes, int]:
    """Byte-level BPE trained over Kimi's pre-tokenization; rank = merge order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_PATTERN), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=NUM_RANKS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(pseudo_sentences(_WORDS, 300, 14, seed=2024), trainer=trainer)
    byte_of = {c: b for b, c in enumerate(BYTE_LEVEL_CHARS)}
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    ranks = {bytes(byte_of[c] for c in text): rank for rank, (text, _) in enumerate(vocab)}
    assert len(ranks) == NUM_RANKS, len(ranks)
    return ranks


def cached_ranks_file(cache_dir: Path) -> bytes:
    """tiktoken.model bytes, trained once and cached."""
    path = cache_dir / f"kimi-tiktoken-{NUM_RANKS}-v1.model"
    if not path.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        lines = [
            base64.b64encode(token) + b" " + str(rank).encode()
            for token, rank in sorted(train_ranks().items(), key=lambda kv: kv[1])
        ]
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(b"\n".join(lines) + b"\n")
        os.replace(tmp, path)
    return path.read_bytes()


def special_ids(base: int = NUM_RANKS) -> dict[str, int]:
    return {name: base + offset for name, offset in KIMI_SPECIAL_OFFSETS.items()}


def write_kimi_tokenizer(out: Path, cache_dir: Path) -> dict[str, int]:
    """Replace out's tokenizer with a Kimi-format one; returns the named special ids. Also points
    config.json / generation_config.json's token ids at it, as Kimi-K2's do."""
    (out / TIKTOKEN_FILE).write_bytes(cached_ranks_file(cache_dir))
    (out / "tokenizer.json").unlink(missing_ok=True)
    ids = special_ids()
    decoder = {
        str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for name, i in ids.items()
    }  # fmt: skip
    config = {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                                      "<|start_header_id|>", "<|end_header_id|>", "[EOT]",
                                      "<|im_system|>", "<|im_middle|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "tokenizer_class": TOKENIZER_CLASS,
    }  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "tokenization_kimi.py").write_text(REMOTE_CODE_TRIPWIRE)
    model_cfg = json.loads((out / "config.json").read_text())
    model_cfg.update(
        bos_token_id=ids["[BOS]"], eos_token_id=ids["[EOS]"], pad_token_id=ids["[PAD]"]
    )
    (out / "config.json").write_text(json.dumps(model_cfg, indent=2))
    gen = {"bos_token_id": ids["[BOS]"], "eos_token_id": ids["<|im_end|>"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return ids
