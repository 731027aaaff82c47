"""The native prompt hasher equals the Python definition of a block's identity, digest for
digest, with and without an extra, with seeds of any length, and on a partial last block."""

import pytest

from hetserve.core.block_hash import hash_prefix_blocks
from hetserve.native.hash_chain import hash_prefix_digests


@pytest.mark.parametrize("extra", [(), ("lora:abc", 7, None)])
@pytest.mark.parametrize("seed", [b"", b"s", bytes(range(32)), b"x" * 100])
@pytest.mark.parametrize("n,bs", [(0, 16), (15, 16), (16, 16), (1000, 16), (999, 64)])
def test_native_chain_equals_python(extra, seed, n, bs):
    ids = [(i * 7919) % 151_000 for i in range(n)]
    assert hash_prefix_digests(ids, bs, extra, seed) == hash_prefix_blocks(ids, bs, extra, seed)
