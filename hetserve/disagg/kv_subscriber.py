"""KVEventSubscriber: follows every instance's KV events into one `KVIndex`.

Who calls it: the Conductor (and tests) create one, `add` each instance by its base URL (its
`/internal/kv_info` says where it publishes and how it hashes), ask `holdings` per request, and
`close` it. A health check that sees an instance restart or go may call `resync` or `remove`.

One thread owns the sockets: a SUB socket per instance, and a DEALER that speaks the replay
socket's REQ framing (`kv_wire.py`). For each live batch of an instance:
- the next sequence number: applied;
- a gap: the missing batches are asked of the replay socket and applied in order; if the replay
  cannot cover the gap (the buffer moved on, or no answer within `replay_timeout_s`), the
  instance is resynced from `/internal/kv_snapshot` (`KVIndex.reset`), and live batches after
  the snapshot's number are applied on top;
- an older number: a duplicate of what a replay already applied, dropped; unless its batch is
  newer than the last one applied (the instance restarted): resynced.
A payload that does not decode counts as a lost batch (a gap). Every `probe_s` an idle
instance is asked for what follows its last batch, so a lost last batch is not missed for long.
An instance is resynced when added. So a lost event or a partial block never leaves the index
wrong for longer than that: the index only ever holds what an instance announced.

Failure contract: an instance that cannot be reached (kv_info at `add` raises `ConnectionError`)
or that stops answering keeps what was last known of it, with its errors counted (`stats`)
and logged; nothing on the thread raises into the Conductor, and `holdings` never waits on I/O.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec
import zmq

from hetserve.config_sections import tcp_endpoint
from hetserve.core.kv_events import KVEventBatch, decode_batch
from hetserve.disagg.index import KVIndex
from hetserve.disagg.kv_wire import END_SEQ, TOPIC, WILDCARD_HOSTS, secure_client, seq_bytes, seq_of

log = logging.getLogger(__name__)


@dataclass
class _Instance:
    name: str
    base_url: str
    token: str | None
    info: dict[str, Any]
    sub: zmq.Socket[bytes] | None = None
    replay: zmq.Socket[bytes] | None = None
    expected: int = 0  # the next sequence number to apply
    last_ts: float = 0.0  # the last applied batch's time stamp
    last_probe: float = 0.0
    snapshot_failing: bool = False  # the last snapshot failed (said once, until one succeeds)
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def fetch_json(base_url: str, path: str, token: str | None, timeout_s: float) -> Any:
    """GET base_url + path as JSON; ConnectionError naming the URL otherwise."""
    try:
        r = httpx.get(base_url + path, headers=_headers(token), timeout=timeout_s)
        r.raise_for_status()
        return r.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise ConnectionError(f"GET {base_url}{path} failed: {exc}") from exc


Fetch = Callable[[str, str, str | None, float], Any]  # (base_url, path, token, timeout) -> JSON


class KVEventSubscriber:
    def __init__(
        self,
        index: KVIndex | None = None,
        *,
        replay_timeout_s: float = 1.0,
        probe_s: float = 2.0,
        http_timeout_s: float = 5.0,
        fetch: Fetch = fetch_json,
    ) -> None:
        self.index = index or KVIndex()
        self.replay_timeout_s, self.probe_s = replay_timeout_s, probe_s
        self.http_timeout_s = http_timeout_s
        self._fetch = fetch  # the instances' /internal routes (tests answer them directly)
        self._lock = threading.Lock()  # the index: written here, read by holdings()
        self._instances: dict[str, _Instance] = {}
        self._by_sub: dict[zmq.Socket[bytes], _Instance] = {}
        self._poller = zmq.Poller()
        self._commands: queue.SimpleQueue[tuple[str, str, _Instance | None]] = queue.SimpleQueue()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hetserve-kv-index")
        self._thread.start()

    # ---- callers ---------------------------------------------------------------------------
    def add(
        self,
        name: str,
        base_url: str,
        token: str | None = None,
        info: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Follow an instance; returns its kv_info (block size, hash seed, where it publishes),
        read from `base_url` unless given."""
        if info is None:
            info = self._fetch(base_url, "/internal/kv_info", token, self.http_timeout_s)
        if not info.get("kv_events"):
            raise ConnectionError(f"{base_url} publishes no KV events (start it with --kv-events)")
        self._commands.put(("add", name, _Instance(name, base_url.rstrip("/"), token, info)))
        return dict(info)

    def remove(self, name: str) -> None:
        self._commands.put(("remove", name, None))

    def resync(self, name: str) -> None:
        self._commands.put(("resync", name, None))

    def rejoined(self, name: str) -> None:
        """The Conductor's health checks saw `name` come back: it may have restarted (on other
        event ports, with another cache), so find its sockets again and resync now rather
        than at the next probe."""
        self._commands.put(("rejoin", name, None))

    def holdings(self, block_hashes: Sequence[bytes]) -> dict[str, dict[str, int]]:
        with self._lock:
            return self.index.holdings(block_hashes)

    def block_counts(self) -> dict[str, dict[str, int]]:
        """Per instance followed and medium: how many blocks the index holds (for /metrics)."""
        with self._lock:
            return {
                n: {m: len(hs) for m, hs in self.index.blocks(n).items()}
                for n in self.index.instances
            }

    def applied(self) -> dict[str, int]:
        """Per instance followed: the last sequence number applied (-1: none)."""
        return {n: i.expected - 1 for n, i in list(self._instances.items())}

    def stats(self) -> dict[str, dict[str, int]]:
        return {n: dict(i.counts) for n, i in list(self._instances.items())}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # ---- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        poller = self._poller
        try:
            while not self._stop.is_set():
                self._take_commands(poller)
                for sock, _ in poller.poll(50):
                    self._receive(self._by_sub[sock])
                now = time.monotonic()
                for inst in list(self._instances.values()):
                    if now - inst.last_probe > self.probe_s:  # a lost last batch, or a restart
                        inst.last_probe = now
                        if not self._replay_from(inst, inst.expected, None):
                            if inst.counts.get("replay_timeouts"):
                                self._follow_moves(inst)
                            self._resync(inst)
        except Exception:  # our bug: the index stops following; say so loudly
            log.exception("the KV event subscriber stopped")
        finally:
            for inst in self._instances.values():
                self._disconnect(inst)
            self._ctx.term()

    def _take_commands(self, poller: zmq.Poller) -> None:
        while True:
            try:
                what, name, inst = self._commands.get_nowait()
            except queue.Empty:
                return
            old = self._instances.get(name)
            if what in ("add", "remove") and old is not None:
                if old.sub is not None:
                    poller.unregister(old.sub)
                    del self._by_sub[old.sub]
                self._disconnect(old)
                del self._instances[name]
                with self._lock:
                    self.index.drop(name)
            if what == "add" and inst is not None:
                self._connect(inst)
                assert inst.sub is not None
                poller.register(inst.sub, zmq.POLLIN)
                self._by_sub[inst.sub] = inst
                self._instances[name] = inst
                self._resync(inst)
            elif what == "resync" and old is not None:
                self._resync(old)
            elif what == "rejoin" and old is not None:
                self._follow_moves(old)
                self._resync(old)

    def _get(self, inst: _Instance, path: str) -> Any:
        return self._fetch(inst.base_url, path, inst.token, self.http_timeout_s)

    def _follow_moves(self, inst: _Instance) -> None:
        """An instance whose replay socket stopped answering may have restarted on other
        ports (bound to port 0): read its kv_info again and reconnect if they moved."""
        try:
            info = self._get(inst, "/internal/kv_info")
        except ConnectionError:
            return
        if info.get("kv_events") and info["kv_events"] != inst.info["kv_events"]:
            assert inst.sub is not None
            self._poller.unregister(inst.sub)
            del self._by_sub[inst.sub]
            self._disconnect(inst)
            inst.info = info
            self._connect(inst)
            assert inst.sub is not None
            self._poller.register(inst.sub, zmq.POLLIN)
            self._by_sub[inst.sub] = inst
            inst.count("moved")

    def _connect(self, inst: _Instance) -> None:
        inst.sub = self._socket(inst, zmq.SUB, "endpoint")
        inst.sub.subscribe(inst.info["kv_events"].get("topic", TOPIC))
        inst.replay = self._socket(inst, zmq.DEALER, "replay_endpoint")

    def _socket(self, inst: _Instance, kind: int, key: str) -> zmq.Socket[bytes]:
        events = inst.info["kv_events"]
        sock = self._ctx.socket(kind)
        sock.linger = 0
        if events.get("curve"):
            secure_client(sock, inst.token or "")
        where, port = tcp_endpoint(events[key])
        host = urlsplit(inst.base_url).hostname or "127.0.0.1"  # for a wildcard bind
        sock.connect(f"tcp://{host if where in WILDCARD_HOSTS else where}:{port}")
        return sock

    def _disconnect(self, inst: _Instance) -> None:
        for sock in (inst.sub, inst.replay):
            if sock is not None:
                sock.close(linger=0)
        inst.sub = inst.replay = None

    # ---- one instance's stream -------------------------------------------------------------
    def _receive(self, inst: _Instance) -> None:
        assert inst.sub is not None
        while True:
            try:
                frames = inst.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                inst.count("malformed")
                continue
            self._on_batch(inst, seq_of(frames[1]), frames[2])

    def _on_batch(self, inst: _Instance, seq: int, payload: bytes) -> None:
        batch = self._decode(inst, payload)
        if seq < inst.expected:
            if batch is not None and batch.ts > inst.last_ts:  # numbering restarted
                inst.count("restarts")
                self._resync(inst)
            return  # else a duplicate of what a replay applied
        if seq > inst.expected:
            inst.count("gaps")
            if not self._replay_from(inst, inst.expected, seq):
                self._resync(inst)
            if seq < inst.expected:
                return  # the replay or the snapshot covered it
        if batch is None:  # it cannot be applied: everything after it waits for a resync
            self._resync(inst)
            return
        self._apply(inst, seq, batch)

    def _decode(self, inst: _Instance, payload: bytes) -> KVEventBatch | None:
        try:
            return decode_batch(payload)
        except msgspec.DecodeError:
            inst.count("undecodable")
            return None

    def _apply(self, inst: _Instance, seq: int, batch: KVEventBatch) -> None:
        with self._lock:
            self.index.apply(inst.name, batch.events)
        inst.expected, inst.last_ts = seq + 1, max(inst.last_ts, batch.ts)
        inst.count("batches")

    def _replay_from(self, inst: _Instance, start: int, upto: int | None) -> bool:
        """Ask for the batches from `start` on and apply them; True if they reached `upto`
        (exclusive; None: whatever there is) without a hole."""
        assert inst.replay is not None
        inst.count("replays")
        inst.replay.send_multipart([b"", seq_bytes(start)])
        ok, deadline = True, time.monotonic() + self.replay_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not inst.replay.poll(round(left * 1000)):
                inst.count("replay_timeouts")
                # A fresh socket: a late answer to this request must not end the next one.
                inst.replay.close(linger=0)
                inst.replay = self._socket(inst, zmq.DEALER, "replay_endpoint")
                return False
            frames = inst.replay.recv_multipart()
            if len(frames) != 3 or frames[1] == END_SEQ:
                break
            seq = seq_of(frames[1])
            if seq < inst.expected or not ok:
                continue  # before what we need, or past a hole: read on to the end marker
            batch = self._decode(inst, frames[2]) if seq == inst.expected else None
            if batch is None:
                ok = False  # the buffer moved on past `start` (or a bad payload)
                continue
            self._apply(inst, seq, batch)
        return ok and (upto is None or inst.expected >= upto)

    def _resync(self, inst: _Instance) -> None:
        """Replace what the index knows of `inst` by its snapshot, then catch up by replay."""
        try:
            body = self._fetch(
                inst.base_url, "/internal/kv_snapshot", inst.token, self.http_timeout_s
            )
            blocks = {m: [bytes.fromhex(h) for h in hs] for m, hs in body["blocks"].items()}
            seq, ts = int(body["seq"]), float(body["ts"])
        except (ConnectionError, KeyError, TypeError, ValueError) as exc:
            inst.count("resync_failures")
            # Said once while the instance is away (retried every probe: a line each 2 s).
            level = logging.DEBUG if inst.snapshot_failing else logging.WARNING
            log.log(level, "KV snapshot of %s failed: %s", inst.name, exc)
            inst.snapshot_failing = True
            return
        if inst.snapshot_failing:
            inst.snapshot_failing = False
            log.warning("KV snapshot of %s taken again: its index is rebuilt", inst.name)
        with self._lock:
            self.index.reset(inst.name, blocks)
        inst.expected, inst.last_ts = seq + 1, ts  # older batches are duplicates from now on
        inst.count("resyncs")
        self._replay_from(inst, inst.expected, None)
