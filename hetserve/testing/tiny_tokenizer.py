"""A small byte-level BPE tokenizer trained offline, with ChatML special tokens, plus a chat
format's marker tokens and template (testing/chat_templates.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from hetserve.testing.chat_templates import ChatFormat

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor -%}\n"
    "{%- if add_generation_prompt -%}\n<|im_start|>assistant\n{% endif -%}\n"
)

_WORDS = (
    "the model serves tokens from experts placed on memory while attention runs on the "
    "accelerator and every cache block keeps one identity across tiers of host memory disk "
    "and remote pools so a request that shares a prefix reuses its key value cache instead of "
    "recomputing it; routers pick a few experts for each token and kernels stream weights near "
    "the bandwidth limit of the machine. hello world, how are you today? I am fine: numbers "
    "0 1 2 3 4 5 6 7 8 9 10 42 100 2048 and symbols ( ) [ ] { } < > + - * / = _ . , ; ! ?"
).split()


def pseudo_sentences(words: Sequence[str], lines: int, per_line: int, seed: int) -> list[str]:
    """Deterministic pseudo-sentences for training the tiny tokenizers: varied enough to learn
    merges, no external data needed. The corpus fixes the trained vocabulary, which cached
    tokenizer files (`-v1`) are named for: change it only with that version."""
    out, state = [], seed
    for _ in range(lines):
        picked = []
        for _ in range(per_line):
            state = (state * 1103515245 + 12345) & 0x7FFFFFFF
            picked.append(words[state % len(words)])
        out.append(" ".join(picked))
    return out


def train_tokenizer(vocab_size: int = 512) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(pseudo_sentences(_WORDS, 400, 12, seed=12345), trainer=trainer)
    return tok


def cached_tokenizer_json(cache_dir: Path, vocab_size: int = 512) -> str:
    """tokenizer.json text, trained once and cached (training takes about a second)."""
    path = cache_dir / f"tokenizer-bpe{vocab_size}-v1.json"
    if not path.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(train_tokenizer(vocab_size).to_str())
        os.replace(tmp, path)
    return path.read_text()


def write_tokenizer_files(
    out: Path, cache_dir: Path, vocab_size: int = 512, chat: ChatFormat | None = None
) -> Tokenizer:
    """tokenizer.json and tokenizer_config.json; with `chat`, its markers as single tokens
    after the trained ones (special where the published tokenizer has them special), its
    template and its end-of-turn token as EOS."""
    tok = Tokenizer.from_str(cached_tokenizer_json(cache_dir, vocab_size))
    if chat is not None:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in chat.markers])
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in chat.specials]
        )
    (out / "tokenizer.json").write_text(tok.to_str())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": chat.bos if chat else None,
        "eos_token": chat.eos[0] if chat and chat.eos else EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "model_max_length": 1 << 20,
        "chat_template": chat.template if chat else CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok
