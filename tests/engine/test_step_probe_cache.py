"""The start-up step probes kept between starts (engine/step_probe.py): a second engine on the
same model and machine takes the kept times without running a probe, the same fit; a change of
what the times depend on (threads, placement, the environment) times them anew; a damaged file
is ignored and rewritten; HETSERVE_STEP_PROBE_CACHE=0 turns it off."""

from __future__ import annotations

import torch

from hetserve import LLM
from hetserve.engine import step_probe
from hetserve.engine.runner import ModelRunner


def _probe_forwards(monkeypatch) -> list[int]:
    calls = [0]
    forward = step_probe._forward

    def counted(runner: ModelRunner, seqs):
        calls[0] += 1
        return forward(runner, seqs)

    monkeypatch.setattr(step_probe, "_forward", counted)
    return calls


def _kept(cache) -> list:
    return sorted((cache / "step-probes").glob("*.json"))


def test_a_second_start_reuses_the_probes(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HETSERVE_CACHE", str(tmp_path))
    calls = _probe_forwards(monkeypatch)
    path = tiny_model("qwen3-moe")
    first = LLM(path)
    assert calls[0] >= 9 and len(_kept(tmp_path)) == 1
    before = calls[0]
    second = LLM(path)
    assert calls[0] == before  # no probe ran
    a, b = first.engine.cost, second.engine.cost
    assert a.prefill_tokens_per_s == b.prefill_tokens_per_s
    assert a.steps.describe() == b.steps.describe()


def test_what_the_times_depend_on_is_timed_anew(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HETSERVE_CACHE", str(tmp_path))
    calls = _probe_forwards(monkeypatch)
    path = tiny_model("qwen3-moe")
    LLM(path)
    n = calls[0]
    LLM(path, placement="device")  # another placement
    assert calls[0] > n and len(_kept(tmp_path)) == 2
    n = calls[0]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        LLM(path)
    finally:
        torch.set_num_threads(threads)
    assert calls[0] > n and len(_kept(tmp_path)) == 3
    n = calls[0]
    monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", "0")
    LLM(path)
    assert calls[0] > n and len(_kept(tmp_path)) == 4


def test_a_damaged_file_is_ignored_and_rewritten(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HETSERVE_CACHE", str(tmp_path))
    calls = _probe_forwards(monkeypatch)
    path = tiny_model("qwen3-moe")
    LLM(path)
    (kept,) = _kept(tmp_path)
    kept.write_text('{"shapes": [[1, 2]], "seconds"')
    n = calls[0]
    LLM(path)
    assert calls[0] > n
    assert kept.read_text().startswith('{"shapes": [[')  # whole again


def test_turned_off_it_times_every_start(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HETSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("HETSERVE_STEP_PROBE_CACHE", "0")
    calls = _probe_forwards(monkeypatch)
    path = tiny_model("qwen3-moe")
    LLM(path)
    n = calls[0]
    LLM(path)
    # each probe runs two or three times (a third where two disagree): the count varies
    assert n >= 14 and calls[0] >= n + 14 and not _kept(tmp_path)
