"""The store contract, run against every backend (see conftest.BACKENDS)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from hetserve.errors import InvalidInputError
from hetserve.store import BufferTooSmallError, InvalidKeyError

from .helpers import MiB, payload


def _key(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:12]}"


@pytest.mark.parametrize("size", [1, 4099, MiB, 64 * MiB])
def test_round_trip(store, size):
    key = _key("rt")
    value = payload(size, key)
    store.put(key, value)
    assert store.exists(key)
    assert store.get(key) == value
    out = np.zeros(size + 5, dtype=np.uint8)
    assert store.get_into(key, out) == size
    assert out[:size].tobytes() == value and not out[size:].any()
    assert store.remove(key)
    assert store.get(key) is None


def test_zero_copy_numpy_and_torch(store):
    src = torch.arange(64 * 1024, dtype=torch.float32)  # 256 KiB
    key = _key("t")
    store.put_from(key, src)
    dst = torch.empty_like(src)
    assert store.get_into(key, dst) == src.numel() * 4
    assert torch.equal(dst, src)
    as_np = np.empty(src.numel() * 2, dtype=np.float16)  # same bytes, another dtype
    assert store.get_into(key, as_np) == src.numel() * 4
    assert as_np.tobytes() == src.numpy().tobytes()
    view = memoryview(bytearray(src.numel() * 4))
    assert store.get_into(key, view) == len(view)
    assert bytes(view) == src.numpy().tobytes()


def test_miss_is_none_never_an_exception(store):
    key = _key("absent")
    assert store.get(key) is None
    assert store.get_into(key, bytearray(16)) is None
    assert not store.exists(key)
    assert not store.remove(key)
    assert store.batch_exists([key]) == 0


def test_bytes_keys_are_their_hex(store):
    raw = uuid.uuid4().bytes
    store.put(raw, b"blk")
    assert store.get(raw.hex()) == b"blk"


def test_caller_errors_are_typed(store):
    with pytest.raises(InvalidKeyError):
        store.put("", b"x")
    with pytest.raises(InvalidKeyError):
        store.put("k" * 1000, b"x")
    key = _key("small")
    store.put(key, b"0123456789")
    with pytest.raises(BufferTooSmallError):
        store.get_into(key, bytearray(4))
    with pytest.raises(InvalidInputError):
        store.get_into(key, b"read-only buffer")


def test_batch_prefix_semantics(store):
    keys = [_key(f"b{i}") for i in range(5)]
    values = [payload(64 * 1024 + i, k) for i, k in enumerate(keys)]
    store.batch_put_from([keys[i] for i in (0, 1, 3, 4)], [values[i] for i in (0, 1, 3, 4)])
    assert store.batch_exists(keys) == 2
    assert store.batch_exists(keys[3:]) == 2
    assert store.batch_exists([]) == 0
    bufs = [bytearray(70 * 1024) for _ in keys]
    got = store.batch_get_into(keys, bufs)
    assert got == [len(values[0]), len(values[1]), None, len(values[3]), len(values[4])]
    for i in (0, 1, 3, 4):
        assert bytes(bufs[i][: got[i]]) == values[i]


def test_concurrent_threads(store):
    errors: list[str] = []

    def worker(t: int) -> None:
        for i in range(12):
            key = f"thr-{uuid.uuid4().hex[:8]}-{t}-{i}"
            value = payload(32 * 1024 + i, key)
            store.put(key, value)
            got = store.get(key)
            if got is not None and got != value:
                errors.append(key)

    shared = _key("hot")
    store.put(shared, payload(MiB, shared))

    def reader() -> None:
        for _ in range(10):
            got = store.get(shared)
            if got is not None and got != payload(MiB, shared):
                errors.append(shared)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors


_CHILD = textwrap.dedent(
    """
    import sys
    from hetserve.store import open_store
    from tests.store.helpers import payload
    store = open_store(sys.argv[1])
    for i in range(10):
        key = f"{sys.argv[2]}-{i}"
        store.put(key, payload(100_000 + i, key))
    store.close()
    """
)


def test_concurrent_processes(backend, store):
    if not backend.shared:
        pytest.skip(f"{backend.name}: an in-process store is not shared between processes")
    tags = [_key("proc") for _ in range(2)]
    root = Path(__file__).resolve().parents[2]  # children import tests.store.helpers
    procs = [
        subprocess.Popen([sys.executable, "-c", _CHILD, backend.spec, tag], cwd=root)
        for tag in tags
    ]
    assert all(p.wait(60) == 0 for p in procs)
    for tag in tags:
        for i in range(10):
            key = f"{tag}-{i}"
            assert store.get(key) == payload(100_000 + i, key)


def test_eviction_under_capacity_pressure(backend, store):
    chunk = max(backend.capacity // 16, MiB)
    keys = [_key(f"ev{i}") for i in range(int(backend.capacity * 1.5) // chunk + 1)]
    for key in keys:
        store.put(key, payload(chunk, key))
    hits = 0
    for key in keys:
        got = store.get(key)
        assert got is None or got == payload(chunk, key)  # never wrong bytes
        hits += got is not None
    assert 0 < hits < len(keys), "eviction must drop some objects and keep some"
    assert store.get(keys[-1]) == payload(chunk, keys[-1])  # the newest survives
    if hasattr(store, "check_integrity"):
        store.check_integrity()
    if hasattr(store, "stats"):  # the pool master checks its invariants while answering
        used_and_cap = store.stats()
        assert used_and_cap["used"] <= used_and_cap["capacity"]


def test_checksum_failure_is_a_miss(backend, store):
    key = _key("bad")
    store.put(key, payload(8192, key))
    backend.corrupt(store, key)
    assert store.get(key) is None
    assert store.get_into(key, bytearray(8192)) is None
