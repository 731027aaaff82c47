"""Small helpers shared by the store tests and the child processes they start."""

from __future__ import annotations

import hashlib

MiB = 1 << 20


def payload(n: int, seed: str) -> bytes:
    """Deterministic bytes that differ per seed (so a wrong object never passes by accident)."""
    block = hashlib.sha256(seed.encode()).digest() * 128  # 4 KiB
    reps = n // len(block) + 1
    return (block * reps)[:n]
