"""Startup self-check and probe of a KV store.

`self_check` writes one probe object, checks that it exists, reads it back and compares the
bytes, then times reads per tier. It fails with one line (`StoreCheckError`) when the store is
unreachable or returns other bytes, so an engine never serves with a silent 0 % hit rate; its
figures (`ProbeResult`) are the tier component's first load-time model, to be refined from real
loads. Reads are timed at two sizes, so a load of n bytes from a tier is predicted as
`latency_s + n / bandwidth`.

Tiers a put can target (`TierInfo.placeable`: the local store's DRAM and SSD) are each measured;
an SSD probe's pages are dropped from the page cache first, so the figure is the disk's. Other
backends are measured in the tier their probe landed in.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from hetserve.store.api import KVStore, Parts, ReplicateConfig, StoreError
from hetserve.store.registry import open_store, parse_spec

SMALL = 1024  # the small probe: its read time is the fixed cost of one load
READS = 5  # timed reads per size and tier; the median is kept
T = TypeVar("T")


class StoreCheckError(StoreError):
    """The store failed its startup check (one line: the store, and what failed)."""


@dataclass(frozen=True)
class TierProbe:
    name: str
    latency_s: float  # the fixed cost of one read
    bandwidth: float  # bytes per second beyond it

    def load_time(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class ProbeResult:
    store: str  # the store's spec, secrets redacted
    nbytes: int
    write_s: float  # one put of `nbytes` (the default tier)
    tiers: dict[str, TierProbe] = field(default_factory=dict)  # the tiers measured, by name

    def load_time(self, tier: str, nbytes: int) -> float | None:
        """Predicted seconds to read `nbytes` from `tier`; None for a tier not measured."""
        probe = self.tiers.get(tier)
        return None if probe is None else probe.load_time(nbytes)


def self_check(
    store: KVStore, key_namespace: str, nbytes: int, *, parts: int = 1, timeout_s: float = 10.0
) -> ProbeResult:
    """Check `store` with a probe of `nbytes` bytes read and written as `parts` buffers (as the
    engine moves a block), under keys that start with `key_namespace`. The whole check is
    bounded by `timeout_s` (a remote store that stops answering is a failure, not a hang)."""
    label = store.label or type(store).__name__
    if nbytes < 1 or not 1 <= parts <= nbytes:
        raise StoreCheckError(f"store self-check of {label}: need 1 <= parts <= nbytes")
    return _bounded(lambda: _Probe(store, key_namespace, nbytes, parts).run(), timeout_s, label)


def open_and_check(
    spec: str, key_namespace: str, nbytes: int, *, parts: int = 1, timeout_s: float = 10.0
) -> tuple[KVStore, ProbeResult]:
    """`open_store(spec)` then `self_check`; either failing is one StoreCheckError line that
    names the spec (secrets redacted)."""
    parsed = parse_spec(spec)  # a malformed spec is the caller's error, as it is
    label = parsed.redacted()
    # A remote service may never answer: bound it. Opening an in-process store cannot hang; it
    # only takes time to fault in its DRAM (seconds per tens of GiB), which is not a failure.
    try:
        if parsed.scheme == "local":
            store = open_store(parsed)
        else:
            store = _bounded(lambda: open_store(parsed), timeout_s, label)
    except StoreCheckError:
        raise
    except StoreError as exc:
        raise StoreCheckError(_line(label, f"cannot open: {exc}")) from None
    try:
        return store, self_check(store, key_namespace, nbytes, parts=parts, timeout_s=timeout_s)
    except BaseException:
        store.close()
        raise


def _line(label: str, what: str) -> str:
    return f"store self-check failed for {label}: " + " ".join(what.split())


def _bounded(fn: Callable[[], T], timeout_s: float, label: str) -> T:
    """Run `fn` in a daemon thread and wait at most `timeout_s` for it."""
    box: list[T] = []
    error: list[BaseException] = []

    def work() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # handed to the caller below
            error.append(exc)

    thread = threading.Thread(target=work, name="store-selfcheck", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise StoreCheckError(_line(label, f"no answer within {timeout_s:g} s"))
    if error:
        raise error[0]
    return box[0]


class _Probe:
    def __init__(self, store: KVStore, namespace: str, nbytes: int, parts: int) -> None:
        self.store, self.nbytes = store, nbytes
        self.label = store.label or type(store).__name__
        tag = uuid.uuid4().hex[:16]
        self.big_key, self.small_key = f"{namespace}/probe-{tag}", f"{namespace}/probe-{tag}-s"
        self.value = os.urandom(nbytes)  # fresh bytes: a stale object can never pass
        self.small = os.urandom(min(SMALL, nbytes))
        cuts = [nbytes * i // parts for i in range(parts + 1)]
        self.src = [memoryview(self.value)[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
        self.dst = [memoryview(bytearray(b - a)) for a, b in zip(cuts, cuts[1:], strict=False)]

    def run(self) -> ProbeResult:
        try:
            return self._run()
        except StoreCheckError:
            raise
        except StoreError as exc:
            raise StoreCheckError(_line(self.label, str(exc))) from None
        finally:
            for key in (self.big_key, self.small_key):
                try:
                    self.store.remove(key)
                except StoreError:
                    pass  # the check's verdict stands; the probe ages out with the rest

    def _run(self) -> ProbeResult:
        t0 = time.perf_counter()
        self.store.put_parts(self.big_key, self.src)
        write_s = time.perf_counter() - t0
        self.store.put(self.small_key, self.small)
        if self.store.batch_exists([self.big_key, self.small_key]) != 2:
            raise StoreCheckError(_line(self.label, "a probe just written does not exist"))
        got = self.store.get_into_parts(self.big_key, self.dst)
        if got is None:
            raise StoreCheckError(_line(self.label, "a probe just written reads as a miss"))
        if b"".join(self.dst) != self.value:
            raise StoreCheckError(_line(self.label, "the probe read back other bytes"))
        default = self.store.batch_locate([self.big_key])[0]
        measured: dict[str, TierProbe] = {}
        for info in self.store.tiers():
            if info.placeable:
                measured[info.name] = self._measure(info.name, info.name)
        if default is not None and default not in measured:
            measured[default] = self._measure(default, None)
        return ProbeResult(self.label, self.nbytes, write_s, measured)

    def _measure(self, tier: str, place: str | None) -> TierProbe:
        t_small = self._timed_reads(
            self.small_key, [memoryview(bytearray(len(self.small)))], tier, place, self.small
        )
        t_big = self._timed_reads(self.big_key, self.dst, tier, place, self.value)
        extra = self.nbytes - len(self.small)
        if extra > 0 and t_big > t_small:
            bandwidth = extra / (t_big - t_small)
        else:  # too close to tell apart: charge everything to bandwidth
            bandwidth = self.nbytes / max(t_big, 1e-9)
        latency = max(t_small - len(self.small) / bandwidth, 0.0)
        return TierProbe(tier, latency, bandwidth)

    def _timed_reads(
        self, key: str, dest: Parts, tier: str, place: str | None, value: bytes
    ) -> float:
        """Median seconds of READS reads of `key` from `tier`. With `place`, the object is put
        back there whenever a read moved it (an SSD hit is promoted to DRAM)."""
        times = []
        for _ in range(READS):
            if place is not None and self.store.batch_locate([key])[0] != place:
                self.store.put(key, value, ReplicateConfig(preferred_segment=place))
            self.store.make_cold(key)
            t0 = time.perf_counter()
            n = self.store.get_into_parts(key, dest)
            times.append(time.perf_counter() - t0)
            if n != len(value):
                raise StoreCheckError(_line(self.label, f"the probe vanished from tier {tier}"))
        return statistics.median(times)
