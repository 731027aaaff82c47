"""The startup self-check: a probe written, found, read back and timed per tier; one-line
failures naming the store when it is unreachable, silent, or returns other bytes."""

from __future__ import annotations

import threading

import pytest

from hetserve.store import open_store, selfcheck
from hetserve.store.backends.local import LocalStore
from hetserve.store.probe_fit import CAPPED, SLOW, UNSTEADY
from hetserve.store.registry import parse_spec
from hetserve.store.selfcheck import StoreCheckError, open_and_check, self_check

from .servers import free_port

KiB = 1024


def _one_line(exc: pytest.ExceptionInfo[StoreCheckError], spec_part: str) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and spec_part in msg and msg.startswith("store self-check failed")
    return msg


def test_every_backend_passes_and_is_probed(store):
    result = self_check(store, "hs-test", 256 * KiB, parts=8)
    located = {t.name for t in store.tiers()}
    assert result.tiers and set(result.tiers) <= located
    for probe in result.tiers.values():
        assert probe.latency_s >= 0 and probe.bandwidth > 0
        assert result.load_time(probe.name, 1 << 20) > result.load_time(probe.name, 1)
    assert result.load_time("no-such-tier", 1) is None and result.write_s > 0
    assert result.store == store.label


def test_local_probes_dram_and_ssd_and_cleans_up(tmp_path):
    store = open_store(f"local://?dram=8M&ssd_dir={tmp_path}&ssd=8M")
    result = self_check(store, "hs-test", 512 * KiB, parts=96)
    assert set(result.tiers) == {"dram", "ssd"}
    for probe in result.tiers.values():  # 8 MiB tiers: reads of up to 8 blocks (half of them)
        assert [n // (512 * KiB) for n, _ in probe.points] == [1, 8] and probe.reads >= 5
    assert result.copy_bandwidth and result.copy_bandwidth > 0
    assert all(t.used == 0 for t in store.tiers())  # the probes are removed
    store.check_integrity()


def test_a_tier_that_cannot_hold_a_block_is_not_probed(tmp_path):
    store = open_store(f"local://?dram=4K&ssd_dir={tmp_path}&ssd=8M")
    result = self_check(store, "hs-test", 64 * KiB, parts=4)
    assert set(result.tiers) == {"ssd"}
    assert [n // (64 * KiB) for n, _ in result.tiers["ssd"].points] == [1, 8, 32]
    assert all(t.used == 0 for t in store.tiers())


BLOCK = 64 * KiB


def _scripted(monkeypatch, seconds, copy=1e10):
    """Time every probe read as `seconds(call, blocks)` instead of by the clock (the reads
    still happen); the copy rate is `copy`."""
    calls = []
    real = selfcheck._Probe.time_read

    def time_read(self, k, tier, place):
        if real(self, k, tier, place) is None:
            return None
        calls.append(k)
        return seconds(len(calls) - 1, k)

    monkeypatch.setattr(selfcheck._Probe, "time_read", time_read)
    monkeypatch.setattr(selfcheck._Probe, "copy_rate", lambda self: copy)
    monkeypatch.setattr(selfcheck, "SECOND_ROUND_S", 1e9)  # whatever this machine's pace
    return calls


def _line(k: int) -> float:
    return 1e-4 + k * BLOCK / 2e9


def _probe_dram(parts: int = 1):
    with open_store("local://?dram=64M") as store:
        return self_check(store, "ns", BLOCK, parts=parts)


def test_steady_reads_are_fitted_once_from_their_medians(monkeypatch):
    slow = {3, 20}  # two disturbed reads
    calls = _scripted(monkeypatch, lambda i, k: _line(k) * (25 if i in slow else 1))
    result = _probe_dram(parts=4)
    dram = result.tiers["dram"]
    assert len(calls) == 15 and dram.reads == 5 and dram.flags == ()
    assert calls[:3] == [1, 8, 32]  # the sizes take turns
    assert dram.latency_s == pytest.approx(1e-4) and dram.bandwidth == pytest.approx(2e9)
    assert result.describe("dram") == "0.10 ms + 2 GB/s; 1/8/32 blocks 0.13/0.36/1.15 ms x5"


def test_scattered_reads_are_measured_again_and_kept_if_the_second_round_is_steady(
    monkeypatch,
):
    noise = [1.0, 3.0, 0.3, 5.0, 1.0]  # the first round, per repeat

    def seconds(i: int, k: int) -> float:
        return _line(k) * (noise[i // 3] if i < 15 else 1.0)

    calls = _scripted(monkeypatch, seconds)
    dram = _probe_dram().tiers["dram"]
    assert len(calls) == 30 and dram.reads == 10 and dram.flags == ()
    assert dram.bandwidth == pytest.approx(2e9)


def test_reads_that_stay_scattered_are_flagged_after_one_second_round(monkeypatch):
    noise = [1.0, 3.0, 0.3, 5.0, 0.2]
    calls = _scripted(monkeypatch, lambda i, k: _line(k) * noise[(i // 3) % 5])
    result = _probe_dram()
    assert len(calls) == 30 and UNSTEADY in result.tiers["dram"].flags
    assert result.describe("dram").endswith("x10; unsteady")


def test_a_memory_tier_is_bounded_by_the_copy_rate_and_held_to_a_floor(monkeypatch):
    _scripted(monkeypatch, lambda i, k: 1e-5 + k * BLOCK / 1e11, copy=1e10)
    fast = _probe_dram().tiers["dram"]
    assert CAPPED in fast.flags and fast.bandwidth == 1e10 and fast.reads == 5
    monkeypatch.undo()
    calls = _scripted(monkeypatch, lambda i, k: 1e-5 + k * BLOCK / 1e8, copy=1e10)
    crawl = _probe_dram().tiers["dram"]
    assert SLOW in crawl.flags and len(calls) == 30  # measured again, then flagged


class _Lying(LocalStore):
    """Claims success but hands back other bytes (a broken backend or a foreign object)."""

    def _get_into(self, names, dests, exact):
        got = super()._get_into(names, dests, exact)
        dests[0][-1][-1] ^= 0xFF
        return got


class _Silent(LocalStore):
    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.release = threading.Event()

    def exists(self, key):
        self.release.wait(30)
        return super().exists(key)

    def batch_exists(self, keys):
        self.release.wait(30)
        return super().batch_exists(keys)


def test_other_bytes_and_silence_fail_in_one_line():
    spec = parse_spec("local://?dram=4M")
    lying = _Lying(spec)
    lying.label = spec.redacted()
    with pytest.raises(StoreCheckError) as exc:
        self_check(lying, "ns", 64 * KiB, parts=3)
    assert "other bytes" in _one_line(exc, "local://?dram=4M")
    silent = _Silent(spec)
    silent.label = spec.redacted()
    with pytest.raises(StoreCheckError) as exc:
        self_check(silent, "ns", 64 * KiB, timeout_s=0.5)
    assert "no answer within 0.5 s" in _one_line(exc, "local://")
    silent.release.set()


def test_unreachable_store_fails_in_one_line_without_its_secret():
    spec = f"pool://127.0.0.1:{free_port()}?token=hunter2&reconnect=0.2"
    with pytest.raises(StoreCheckError) as exc:
        open_and_check(spec, "ns", 4 * KiB)
    msg = _one_line(exc, "pool://127.0.0.1:")
    assert "cannot open" in msg and "hunter2" not in msg and "token=***" in msg
    with pytest.raises(StoreCheckError) as exc:
        self_check(open_store("local://?dram=1M&max_value=1K"), "ns", 4 * KiB)
    assert "exceeds max_value" in _one_line(exc, "local://")
