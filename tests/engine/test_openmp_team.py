"""One OpenMP team on the cores: the thread that built an AsyncLLM's engine hands its team back
before the engine thread takes over (hetserve/native/openmp.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from hetserve.config import EngineConfig
from hetserve.engine import async_llm
from hetserve.engine.async_llm import AsyncLLM
from hetserve.native import openmp


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _threads_once(expect: int, timeout_s: float = 5.0) -> int:
    """The process's thread count once it is `expect` (workers exit asynchronously), or as it
    is after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while _threads() != expect and time.monotonic() < deadline:
        time.sleep(0.01)
    return _threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_release_frees_the_calling_threads_team_and_only_its_own():
    if not openmp._loaded_runtimes():
        pytest.skip("torch here does not run on GNU OpenMP (libgomp)")
    if torch.get_num_threads() < 2:
        pytest.skip("a team needs 2 threads; torch runs 1 here")
    seen: dict[str, int] = {}
    done, go = threading.Event(), threading.Event()

    def parallel_region() -> None:
        torch.ones(1 << 22).sum()  # large enough for ATen to split across its team

    def owner() -> None:  # a second thread keeps its team throughout
        parallel_region()
        done.set()
        go.wait(10)

    def releaser() -> None:
        parallel_region()
        seen["with"] = _threads()
        seen["released"] = openmp.release_thread_team()
        seen["after"] = _threads_once(seen["with"] - 1)
        parallel_region()  # a region after it: a new team, same results
        seen["again"] = _threads()

    other = threading.Thread(target=owner)
    other.start()
    assert done.wait(10)
    t = threading.Thread(target=releaser)
    t.start()
    t.join(30)
    go.set()
    other.join(10)
    assert seen["released"] is True
    # torch's team of 2: one worker beside the thread itself, gone; the other thread's stays
    assert seen["after"] == seen["with"] - 1
    assert seen["again"] == seen["with"]


def test_release_without_a_runtime_does_nothing(monkeypatch):
    monkeypatch.setattr(openmp, "_loaded_runtimes", lambda: [])
    assert openmp.release_thread_team() is False
    monkeypatch.setattr(openmp, "_loaded_runtimes", lambda: ["/nonexistent/libgomp.so.1"])
    assert openmp.release_thread_team() is False  # not loaded: never a second copy, no error


def test_async_llm_releases_the_builders_team_before_its_engine_thread_starts(
    tiny_model, monkeypatch
):
    calls = []

    def engine_threads() -> set[threading.Thread]:  # started ones: enumerate lists no others
        return {t for t in threading.enumerate() if t.name == "hetserve-engine"}

    before = engine_threads()

    def record() -> bool:
        calls.append((threading.current_thread(), engine_threads() - before))
        return True

    monkeypatch.setattr(async_llm, "release_thread_team", record)
    llm = AsyncLLM(EngineConfig(model=str(tiny_model("qwen3-moe"))))
    try:
        assert len(calls) == 1
        thread, started = calls[0]
        assert thread is threading.current_thread()  # the thread that built the engine
        assert not started  # its engine thread had not started yet
        assert llm.is_alive and llm._thread in engine_threads()
    finally:
        llm.shutdown()


def test_an_engine_hands_back_its_builds_team_after_the_probes(tiny_model, monkeypatch):
    from hetserve.engine import core
    from hetserve.engine.llm import LLM

    order = []
    probes = core.measure_steps
    monkeypatch.setattr(core, "measure_steps", lambda *a: (order.append("probes"), probes(*a)))
    monkeypatch.setattr(core, "release_thread_team", lambda: order.append("release") or True)
    llm = LLM(str(tiny_model("qwen3-moe")))
    assert order == ["probes", "release"]  # the start-up probes ran on the team, then it went
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False)  # a step makes a new one
    assert len(out[0].outputs[0].token_ids) > 0
