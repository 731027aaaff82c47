"""A prompt's chained block hashes in one native call (`hashing.c`), equal to
`core.block_hash.hash_prefix_blocks` digest for digest, for callers that hash whole long prompts
(the Conductor). Falls back to the Python definition where the kernels or OpenSSL's SHA-256
are not available."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hetserve.core.block_hash import BlockHash, CacheExtra, _encode_extra, hash_prefix_blocks


def hash_prefix_digests(
    token_ids: Sequence[int], block_size: int, extra: CacheExtra = (), seed: bytes = b""
) -> list[BlockHash]:
    n = len(token_ids) // block_size
    if n == 0:
        return []
    from hetserve.native import optional_kernel

    fn = optional_kernel("hetserve_hash_blocks")
    if fn is None:
        return hash_prefix_blocks(token_ids, block_size, extra, seed)
    tokens = np.ascontiguousarray(np.asarray(token_ids[: n * block_size], dtype=np.int64))
    extra_b = _encode_extra(extra)
    out = np.empty(32 * n, dtype=np.uint8)
    seed_a = np.frombuffer(seed or b"\0", dtype=np.uint8)
    extra_a = np.frombuffer(extra_b or b"\0", dtype=np.uint8)
    rc = fn(seed_a.ctypes.data, len(seed), tokens.ctypes.data, n, block_size,
            extra_a.ctypes.data, len(extra_b), out.ctypes.data)  # fmt: skip
    if rc != 0:
        return hash_prefix_blocks(token_ids, block_size, extra, seed)
    raw = out.tobytes()
    return [BlockHash(raw[32 * i : 32 * (i + 1)]) for i in range(n)]
