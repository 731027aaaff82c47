"""The startup self-check: a probe written, found, read back and timed per tier; one-line
failures naming the store when it is unreachable, silent, or returns other bytes."""

from __future__ import annotations

import threading

import pytest

from hetserve.store import open_store
from hetserve.store.backends.local import LocalStore
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
    assert all(t.used == 0 for t in store.tiers())  # the probes are removed
    store.check_integrity()


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
