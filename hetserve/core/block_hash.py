"""BlockHash: the one identity of a full block of cached KV, in every tier.

A block's hash chains its parent's hash, its token ids and an `extra` tuple carrying whatever
changes the KV (model, LoRA id, cache salt, dtype, layout). Equal hashes mean reusable KV.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockHash:
    digest: bytes  # sha256 of the canonical encoding below

    def hex(self) -> str:
        return self.digest.hex()

    def __repr__(self) -> str:
        return f"BlockHash({self.digest.hex()[:16]})"


# What changes a block's KV besides its tokens: model, LoRA id, cache salt, dtype, layout...
CacheExtra = tuple[str | int | float | bytes | None, ...]


def _encode_extra(extra: CacheExtra) -> bytes:
    # Canonical: repr of str/int/float/bytes/None items; anything else is our bug.
    parts = []
    for item in extra:
        assert isinstance(item, str | int | float | bytes | type(None)), type(item)
        parts.append(repr(item).encode())
    return b"\x1f".join(parts)


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra: CacheExtra = (),
    seed: bytes = b"",
) -> BlockHash:
    """Hash one full block. `seed` makes the root differ between deployments (NONE_HASH-like)."""
    h = hashlib.sha256()
    h.update(seed if parent is None else parent.digest)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(_encode_extra(extra))
    return BlockHash(h.digest())


def hash_prefix_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra: CacheExtra = (),
    seed: bytes = b"",
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids` (a trailing partial block is skipped)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra, seed)
        hashes.append(parent)
    return hashes


def salt_extra(salt: object) -> CacheExtra:
    """A request's cache salt (vLLM's `cache_salt`) as its blocks' hash extra: the instances
    and the Conductor hash it the same way. Anything but a non-empty string is no salt."""
    return (f"salt:{salt}",) if isinstance(salt, str) and salt else ()
