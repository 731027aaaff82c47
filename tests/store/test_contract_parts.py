"""The store contract for multi-part values and tier location, run against every backend.

The parts are laid out as the engine's paged KV cache lays them out: one tensor per layer and
entry (K, V), indexed by slot, so one block is a slice of each of 2 x num_layers tensors.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from hetserve.errors import InvalidInputError
from hetserve.store import SizeMismatchError

from .helpers import payload


def _key(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:12]}"


class FakeKV:
    """Per layer a K and a V tensor of [num_blocks * block_size, heads, dim]."""

    def __init__(
        self,
        layers: int,
        blocks: int,
        block_size: int = 16,
        heads: int = 2,
        dim: int = 32,
        seed: int | None = None,
        dtype=torch.float32,
    ) -> None:
        self.block_size = block_size
        shape = (blocks * block_size, heads, dim)
        if seed is None:
            self.tensors = [torch.zeros(shape, dtype=dtype) for _ in range(2 * layers)]
        else:
            g = torch.Generator().manual_seed(seed)
            self.tensors = [torch.randn(shape, generator=g).to(dtype) for _ in range(2 * layers)]

    def parts(self, block: int) -> list[torch.Tensor]:
        lo = block * self.block_size
        return [t[lo : lo + self.block_size] for t in self.tensors]

    def block_bytes(self, block: int) -> bytes:
        return b"".join(p.detach().view(torch.uint8).numpy().tobytes() for p in self.parts(block))


def test_parts_round_trip_torch_kv_layout(store):
    src = FakeKV(layers=48, blocks=3, seed=1)  # 96 parts per block, as a 48-layer model has
    dst = FakeKV(layers=48, blocks=3)
    keys = [_key(f"kv{b}") for b in range(3)]
    store.put_parts(keys[0], src.parts(0))
    store.batch_put_parts(keys[1:], [src.parts(1), src.parts(2)])
    n = len(src.block_bytes(0))
    assert store.get_into_parts(keys[0], dst.parts(2)) == n  # any block can receive any block
    assert store.batch_get_into_parts(keys[1:], [dst.parts(0), dst.parts(1)]) == [n, n]
    assert dst.block_bytes(2) == src.block_bytes(0)
    assert dst.block_bytes(0) == src.block_bytes(1)
    assert dst.block_bytes(1) == src.block_bytes(2)
    # One value, whatever its cut: parts in, one buffer out, and the reverse.
    assert store.get(keys[0]) == src.block_bytes(0)
    whole = np.frombuffer(src.block_bytes(1), dtype=np.uint8).copy()
    key = _key("whole")
    store.put_from(key, whole)
    assert store.get_into_parts(key, dst.parts(0)) == n
    assert dst.block_bytes(0) == whole.tobytes()


def test_parts_of_odd_sizes_and_empty_parts(store):
    sizes = [1, 0, 4099, 0, 70_000, 3]
    value = payload(sum(sizes), "odd")
    cuts = np.cumsum([0, *sizes])
    parts = [memoryview(value)[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    key = _key("odd")
    store.put_parts(key, parts)
    dest = [bytearray(n) for n in reversed(sizes)]  # cut differently on the way back
    assert store.get_into_parts(key, dest) == len(value)
    assert b"".join(dest) == value
    empty = _key("empty")
    store.put_parts(empty, [])
    assert store.get_into_parts(empty, []) == 0
    assert store.get(empty) == b""


def test_parts_miss_is_none_in_its_place(store):
    keys = [_key("p0"), _key("absent"), _key("p2")]
    for k in (keys[0], keys[2]):
        store.put_parts(k, [payload(1000, k), payload(2000, k + "b")])
    dests = [[bytearray(1000), bytearray(2000)] for _ in keys]
    assert store.batch_get_into_parts(keys, dests) == [3000, None, 3000]
    assert bytes(dests[2][1]) == payload(2000, keys[2] + "b")
    assert store.get_into_parts(keys[1], [bytearray(8)]) is None
    assert store.batch_get_into_parts([], []) == []


def test_parts_wrong_destination_sizes_are_errors(store):
    key = _key("sz")
    store.put_parts(key, [payload(4096, key), payload(4096, key + "2")])
    for dest in (
        [bytearray(4096), bytearray(4095)],
        [bytearray(4096), bytearray(4097)],
        [bytearray(8192), bytearray(1)],
        [bytearray(10)],
    ):
        with pytest.raises(SizeMismatchError, match="8192"):
            store.get_into_parts(key, dest)
    with pytest.raises(SizeMismatchError):
        store.batch_get_into_parts([key], [[bytearray(100)]])
    ok = [bytearray(5000), bytearray(3192)]
    assert store.get_into_parts(key, ok) == 8192  # only the total matters, not the cut
    with pytest.raises(InvalidInputError, match="list or tuple"):
        store.get_into_parts(key, bytearray(8192))  # one buffer is not a list of parts
    with pytest.raises(InvalidInputError, match="writable"):
        store.get_into_parts(key, [bytes(8192)])
    with pytest.raises(InvalidInputError, match="keys but"):
        store.batch_put_parts([key], [])


def test_parts_checksum_failure_is_a_miss(backend, store):
    key = _key("badparts")
    parts = [payload(3000, key), payload(5192, key + "x")]
    store.put_parts(key, parts)
    backend.corrupt(store, key)
    dest = [bytearray(3000), bytearray(5192)]
    assert store.get_into_parts(key, dest) is None
    assert store.batch_get_into_parts([key], [dest]) == [None]


def test_batch_locate_prefix_semantics(store):
    keys = [_key(f"loc{i}") for i in range(5)]
    for i in (0, 1, 3, 4):
        store.put(keys[i], payload(8192, keys[i]))
    names = {t.name for t in store.tiers()}
    got = store.batch_locate(keys)
    assert got[:2] == [got[0]] * 2 and got[0] in names
    assert got[2:] == [None, None, None]  # the run stops at the first miss
    assert store.batch_locate(keys[3:]) == [got[0]] * 2
    assert store.batch_locate([]) == []
    assert store.batch_locate([keys[2]]) == [None]
    assert len(store.batch_locate(keys[:2])) == store.batch_exists(keys) == 2


def test_tiers_describe_the_store(backend, store):
    tiers = store.tiers()
    assert tiers and len({t.name for t in tiers}) == len(tiers)
    for t in tiers:
        assert t.shared == backend.shared
        if t.capacity is not None and t.used is not None:
            assert 0 <= t.used and 0 < t.capacity
    assert store.label.split(":")[0] == backend.spec.split(":")[0]


def test_parts_bf16_and_grad_tensors(store):
    src = FakeKV(layers=2, blocks=1, seed=3, dtype=torch.bfloat16)  # numpy has no bfloat16
    src.tensors[0].requires_grad_(True)
    dst = FakeKV(layers=2, blocks=1, dtype=torch.bfloat16)
    key = _key("bf16")
    store.put_parts(key, src.parts(0))
    assert store.get_into_parts(key, dst.parts(0)) == len(src.block_bytes(0))
    assert all(torch.equal(a.detach(), b) for a, b in zip(src.tensors, dst.tensors, strict=True))
