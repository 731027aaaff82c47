"""Synthetic token-id prompts for a checkpoint: calibration (`hetserve calibrate`) and the offline
benchmarks use the same ones, so routing statistics and timings see the same kind of input."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def make_prompts(
    model_dir: str | Path,
    n: int,
    length: int,
    seed: int = 0,
    lengths: list[int] | None = None,
) -> list[list[int]]:
    """`n` random prompts of `length` tokens (or `lengths[i]` each), reproducible from `seed`."""
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    # Ids from the low range only: random tiny tokenizers map high ids to special tokens.
    ids = torch.randint(10, min(vocab, 400), (n, max(lengths or [length])), generator=g)
    return [row[: (lengths[i] if lengths else length)].tolist() for i, row in enumerate(ids)]
