"""KeyTable against a dict, through puts, removals, rebuilds and lookups of absent keys; the
native probe loop and numpy's give the same columns."""

import random

import numpy as np

from hetserve.disagg import key_table
from hetserve.disagg.key_table import KeyTable, keys_of


def test_key_table_matches_a_dict(monkeypatch):
    rng = random.Random(5)
    table, truth = KeyTable(capacity=8), {}
    digests = [rng.randbytes(32) for _ in range(3000)]
    for step in range(20000):
        h = rng.choice(digests)
        k = int(keys_of(h)[0])
        if rng.random() < 0.6:
            col = rng.randrange(1, 10**6)
            table.put(k, col)
            truth[k] = col
        else:
            table.remove(k)
            truth.pop(k, None)
        if step % 2500 == 0:
            keys = keys_of(b"".join(digests))
            want = np.array([truth.get(int(x), 0) for x in keys])
            assert (table.lookup(keys) == want).all()
            monkeypatch.setattr(key_table, "_native_lookup", lambda: None)
            assert (table.lookup(keys) == want).all()
            monkeypatch.undo()
    assert len(table) == len(truth)


def test_reserved_key_values_are_never_keys():
    digests = [bytes(32), (1).to_bytes(8, "little") + bytes(24), bytes(24) + bytes([1] * 8)]
    keys = keys_of(b"".join(digests)).tolist()
    assert keys[0] == 2 and min(keys) > 1  # the all-zero digest folds to 0: shifted


def test_index_stays_exact_when_two_hashes_share_a_key(monkeypatch):
    from hetserve.core.kv_events import MEDIUM_GPU
    from hetserve.disagg.index import KVIndex

    monkeypatch.setattr(key_table, "_MIX", np.zeros(3, np.uint64))  # every key is word 3
    monkeypatch.setattr(key_table, "_native_digest_lookup", lambda: None)  # folds with the real
    a, b = bytes(24) + b"sameword", b"x" * 24 + b"sameword"  # one key, two hashes
    index = KVIndex()
    index.mark("i", MEDIUM_GPU, [a], True)
    index.mark("j", MEDIUM_GPU, [b], True)
    assert index.holdings([a]) == {"i": {"device": 1, "dram": 1, "ssd": 1}}
    assert index.holdings([b]) == {"j": {"device": 1, "dram": 1, "ssd": 1}}
    index.mark("j", MEDIUM_GPU, [b], False)  # alone again: back in the table
    assert index.holdings([a]) == {"i": {"device": 1, "dram": 1, "ssd": 1}}
    assert index.holdings([b]) == {}


def test_native_digest_lookup_folds_probes_and_checks_as_numpy_does():
    if key_table._native_digest_lookup() is None:
        import pytest

        pytest.skip("the native kernels do not build here")
    rng = random.Random(9)
    digests = [rng.randbytes(32) for _ in range(500)] + [bytes(32)]  # one folds to a reserved key
    stored = np.zeros((len(digests) + 1, 4), np.uint64)
    table = KeyTable(capacity=8)
    for col, h in enumerate(digests[:300] + [bytes(32)], 1):
        table.put(int(keys_of(h)[0]), col)
        stored[col] = np.frombuffer(h, "<u8")
    stored[7] = 0  # column 7 now names another hash: its key's hit must not count
    joined = b"".join(digests)
    keys = keys_of(joined)
    want = table.lookup(keys)
    want[~(stored[want] == np.frombuffer(joined, "<u8").reshape(-1, 4)).all(axis=1)] = 0
    got = table.lookup_digests(joined, stored)
    assert got is not None and (got == want).all()
    assert got[6] == 0 and got[5] == 6 and got[-1] == 301 and (got[300:-1] == 0).all()
