"""The native kernels' parallel loop (hetserve/native/pool.c): every item runs exactly once,
whatever the thread count and however unevenly items take time (threads own contiguous ranges
and steal from each other's ends)."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest

from hetserve import native

pytestmark = pytest.mark.skipif(
    bool(native.native_unavailable_reason()), reason="native kernels unavailable"
)

_TASK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int)


def _loop():
    fn = native._build()[0].hs_parallel_for
    fn.restype, fn.argtypes = None, [ctypes.c_int, ctypes.c_int, _TASK, ctypes.c_void_p]
    return fn


def _run(nthreads: int, total: int, slow: frozenset[int] = frozenset()) -> list[list[int]]:
    fn = _loop()
    seen: list[list[int]] = [[] for _ in range(total)]
    lock = threading.Lock()

    def item(_ctx, i):
        if i in slow:
            time.sleep(0.01)
        with lock:
            seen[i].append(threading.get_ident())

    fn(nthreads, total, _TASK(item), None)
    return seen


@pytest.mark.parametrize(
    "nthreads,total", [(1, 0), (2, 0), (1, 5), (2, 1), (2, 7), (3, 10), (4, 64), (8, 3), (0, 4)]
)
def test_every_item_runs_exactly_once(nthreads, total):
    assert [len(s) for s in _run(nthreads, total)] == [1] * total


def test_a_slow_item_holds_back_only_itself():
    # item 0 (the first thread's first) and item 9 sleep; all others still run, each once
    seen = _run(2, 16, frozenset({0, 9}))
    assert [len(s) for s in seen] == [1] * 16


def test_a_smaller_team_than_asked_for_loses_no_item():
    # inside a parallel region OpenMP gives a nested loop one thread: the ranges meant for the
    # others must be stolen by it, not dropped
    inner: list[list[list[int]]] = []
    outer = _run_nested(2, lambda: inner.append(_run(3, 9)))
    assert [len(s) for s in outer] == [1, 1]
    assert len(inner) == 2 and all([len(s) for s in r] == [1] * 9 for r in inner)


def _run_nested(nthreads: int, body) -> list[list[int]]:
    fn = _loop()
    seen: list[list[int]] = [[] for _ in range(nthreads)]

    def item(_ctx, i):
        body()
        seen[i].append(threading.get_ident())

    fn(nthreads, nthreads, _TASK(item), None)
    return seen
