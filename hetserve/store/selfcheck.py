"""Startup self-check and probe of a KV store.

`self_check` writes one probe object, checks that it exists, reads it back and compares the
bytes, then times reads per tier. It fails with one line (`StoreCheckError`) when the store is
unreachable or returns other bytes, so an engine never serves with a silent 0 % hit rate; its
figures (`ProbeResult`) are the tier component's first load-time model, to be refined from real
loads.

Each tier is timed as the engine loads: batched reads of 1, 8 and 32 block-sized objects
(fewer where the blocks are large or the tier small), interleaved, several times each; a line
through the sizes' medians (`probe_fit.py`) predicts a load of n bytes as
`latency_s + n / bandwidth`, capped at this machine's memory copy rate, measured here too. A
tier whose reads scatter is measured again with as many reads more, and stays flagged if they
still do. Tiers a put can target (`TierInfo.placeable`: the local store's DRAM and SSD) are
each measured; an SSD probe's pages are dropped from the page cache before every read, so the
figure is the disk's. Other backends are measured in the tier their probe landed in.
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

from hetserve.store.api import (
    TIER_DRAM,
    TIER_POOL_SHM,
    KVStore,
    ReplicateConfig,
    StoreCapacityError,
    StoreError,
    TierInfo,
)
from hetserve.store.probe_fit import FLAT, SLOW, UNSTEADY, fit_tier
from hetserve.store.registry import open_store, parse_spec

SIZES = (1, 8, 32)  # blocks per batched read
READS = 5  # timed reads per size and tier (a tier measured again: as many more)
MAX_READ_BYTES = 16 << 20  # the largest batched read probed (start-up time: SSD tiers)
SECOND_ROUND_S = 2.0  # a tier whose first round took longer is not measured again
MEMORY_TIERS = frozenset({TIER_DRAM, TIER_POOL_SHM})  # a read is a copy and a checksum
T = TypeVar("T")


class StoreCheckError(StoreError):
    """The store failed its startup check (one line: the store, and what failed)."""


@dataclass(frozen=True)
class TierProbe:
    name: str
    latency_s: float  # the fixed cost of one batched read
    bandwidth: float  # bytes per second beyond it
    points: tuple[tuple[int, float], ...] = ()  # (bytes per batched read, median seconds)
    flags: tuple[str, ...] = ()  # what probe_fit found doubtful ("unsteady", "capped at copy")
    reads: int = 0  # timed reads per size behind each median

    def load_time(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class ProbeResult:
    store: str  # the store's spec, secrets redacted
    nbytes: int
    write_s: float  # one put of `nbytes` (the default tier)
    tiers: dict[str, TierProbe] = field(default_factory=dict)  # the tiers measured, by name
    copy_bandwidth: float | None = None  # this machine's memory copy rate, bytes per second

    def load_time(self, tier: str, nbytes: int) -> float | None:
        """Predicted seconds to read `nbytes` from `tier`; None for a tier not measured."""
        probe = self.tiers.get(tier)
        return None if probe is None else probe.load_time(nbytes)

    def describe(self, tier: str) -> str | None:
        """What was measured for `tier`, for the start-up line: the fit, then each size's
        median read ("1/8/32 blocks 0.05/0.21/0.80 ms"), and any doubt."""
        p = self.tiers.get(tier)
        if p is None:
            return None
        sizes = "/".join(str(n // self.nbytes) for n, _ in p.points)
        times = "/".join(f"{t * 1e3:.2f}" for _, t in p.points)
        doubt = "".join(f"; {f}" for f in p.flags)
        return (
            f"{p.latency_s * 1e3:.2f} ms + {p.bandwidth / 1e9:.3g} GB/s; {sizes} blocks "
            f"{times} ms x{p.reads}{doubt}"
        )


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
        self.most = max(1, min(max(SIZES), MAX_READ_BYTES // nbytes))  # blocks in one read
        self.keys = [f"{namespace}/probe-{tag}-{i}" for i in range(self.most)]
        self.value = os.urandom(nbytes)  # fresh bytes: a stale object can never pass
        cuts = [nbytes * i // parts for i in range(parts + 1)]
        self.src = [memoryview(self.value)[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
        # One destination per object of the largest read, cut in parts as the engine's blocks.
        self.dst = [
            [memoryview(bytearray(b - a)) for a, b in zip(cuts, cuts[1:], strict=False)]
            for _ in range(self.most)
        ]
        self.copy_bandwidth: float | None = None

    def run(self) -> ProbeResult:
        try:
            return self._run()
        except StoreCheckError:
            raise
        except StoreError as exc:
            raise StoreCheckError(_line(self.label, str(exc))) from None
        finally:
            for key in self.keys:
                try:
                    self.store.remove(key)
                except StoreError:
                    pass  # the check's verdict stands; the probe ages out with the rest

    def _run(self) -> ProbeResult:
        key = self.keys[0]
        t0 = time.perf_counter()
        self.store.put_parts(key, self.src)
        write_s = time.perf_counter() - t0
        if self.store.batch_exists([key]) != 1:
            raise StoreCheckError(_line(self.label, "a probe just written does not exist"))
        got = self.store.get_into_parts(key, self.dst[0])
        if got is None:
            raise StoreCheckError(_line(self.label, "a probe just written reads as a miss"))
        if b"".join(self.dst[0]) != self.value:
            raise StoreCheckError(_line(self.label, "the probe read back other bytes"))
        default = self.store.batch_locate([key])[0]
        self.copy_bandwidth = self.copy_rate()
        infos = {info.name: info for info in self.store.tiers()}
        measured: dict[str, TierProbe] = {}
        for info in infos.values():
            if info.placeable and (probe := self._measure(info, info.name)) is not None:
                measured[info.name] = probe
        if default is not None and default not in measured:
            info = infos.get(default, TierInfo(default, None, None, shared=False))
            if (probe := self._measure(info, None)) is not None:
                measured[default] = probe
        return ProbeResult(self.label, self.nbytes, write_s, measured, self.copy_bandwidth)

    def copy_rate(self) -> float:
        """Bytes per second of one thread's memory copy, at the size of the largest probe
        read (so both come from the same level of the memory hierarchy)."""
        n = max(self.most * self.nbytes, 1 << 20)
        src, dst = memoryview(b"\x01" * n), memoryview(bytearray(n))
        times = []
        for _ in range(READS + 1):  # the first copy faults the destination's pages in
            t0 = time.perf_counter()
            dst[:] = src
            times.append(time.perf_counter() - t0)
        return n / max(statistics.median(times[1:]), 1e-9)

    def _measure(self, info: TierInfo, place: str | None) -> TierProbe | None:
        """Fit `info`'s tier from rounds of timed reads; None where it cannot hold a block.
        With `place`, the probe objects are put there; else they are read where they land."""
        room = self.most
        if info.capacity is not None:  # leave the tier at least half free
            room = max(1, min(room, info.capacity // (2 * self.nbytes)))
        sizes = sorted({min(k, room) for k in SIZES})
        samples: dict[int, list[float]] = {}
        t0 = time.perf_counter()
        rounds = 1
        self._round(info.name, place, sizes, samples)
        if not samples:
            return None
        memory = info.name in MEMORY_TIERS
        fit = fit_tier(samples, self.copy_bandwidth, memory)
        doubtful = {UNSTEADY, FLAT, SLOW} & set(fit.flags)
        if doubtful and time.perf_counter() - t0 < SECOND_ROUND_S:
            rounds = 2
            self._round(info.name, place, sizes, samples)
            fit = fit_tier(samples, self.copy_bandwidth, memory)
        return TierProbe(
            info.name, fit.latency_s, fit.bandwidth, fit.points, fit.flags, READS * rounds
        )

    def _round(
        self, tier: str, place: str | None, sizes: list[int], samples: dict[int, list[float]]
    ) -> None:
        """READS timed reads of each size, the sizes interleaved (a slow moment then touches
        every size alike instead of bending the line); a size the tier cannot hold is dropped
        with the larger ones."""
        for _ in range(READS):
            for k in list(sizes):
                seconds = self.time_read(k, tier, place)
                if seconds is None:
                    del sizes[sizes.index(k) :]
                    for big in [n for n in samples if n >= k * self.nbytes]:
                        del samples[big]
                    break
                samples.setdefault(k * self.nbytes, []).append(seconds)

    def time_read(self, k: int, tier: str, place: str | None) -> float | None:
        """Seconds of one batched read of k probe objects from `tier`, cold; None when they
        cannot all be there. The objects are put back where a read moved them (an SSD hit is
        promoted to DRAM)."""
        keys = self.keys[:k]
        stray = [
            key for key, t in zip(keys, self.store.batch_locate(keys), strict=True) if t != tier
        ]
        if stray:
            config = ReplicateConfig(preferred_segment=place) if place else None
            try:
                self.store.batch_put_parts(stray, [self.src] * len(stray), config)
            except StoreCapacityError:
                return None
            if any(t != tier for t in self.store.batch_locate(keys)):
                return None
        for key in keys:
            self.store.make_cold(key)
        t0 = time.perf_counter()
        got = self.store.batch_get_into_parts(keys, self.dst[:k])
        seconds = time.perf_counter() - t0
        if any(n != self.nbytes for n in got):
            raise StoreCheckError(_line(self.label, f"the probe vanished from tier {tier}"))
        return seconds
