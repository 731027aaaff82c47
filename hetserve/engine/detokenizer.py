"""Incremental detokenizer with stop strings.

Decodes a small window of tokens per step rather than the whole output (byte-level BPE can split
a character across tokens, so a delta ending in U+FFFD waits for the next token). Text that could
still be the start of a stop string is held back from streaming until it is decided.
"""

from __future__ import annotations

from hetserve.model.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5  # prompt tokens decoded as left context so the first delta is right


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: tuple[str, ...] = (),
        include_stop_str: bool = False,
        skip_special_tokens: bool = True,
        hidden_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop_str
        self.skip_special = skip_special_tokens
        # Tokens that end generation (EOS, stop_token_ids): never text, even when specials are
        # spelled out (vLLM leaves them out too).
        self.hidden = hidden_ids if not skip_special_tokens else frozenset()
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.stopped_by: str | None = None

    def add(self, token_id: int) -> str | None:
        """Append one token; returns the stop string if it ended generation."""
        if token_id in self.hidden:
            return None
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            old_len = len(self.text)
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return self._check_stop(old_len)
        return None

    def _check_stop(self, old_len: int) -> str | None:
        if not self.stop:
            return None
        start = max(0, old_len - self.holdback)
        best = None
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
        self.stopped_by = s
        return s

    def visible_text(self, finished: bool) -> str:
        """Text safe to stream: all of it once finished, else minus a possible partial stop."""
        if finished or self.holdback == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]
