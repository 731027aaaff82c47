"""KVEventPublisher: an instance's KV events on ZMQ, as vLLM publishes them, with replay.

Who calls it: the engine opens one at start when KV events are on (`open_publisher`, from
`--kv-events tcp://HOST:PORT`); its thread takes what the recorder (`kv/events.py`) recorded
every `interval_s`, numbers it (one batch, one sequence number) and sends it on the PUB socket;
it answers replay requests from a buffer of the last `buffer_batches` batches (frames and
protocol: `kv_wire.py`). The server's `/internal/kv_snapshot` reads `snapshot()`: every block the
instance holds per medium, current as of a sequence number, for subscribers that lost more than
the buffer holds. `close()` (the engine's) records that the instance holds nothing, sends it,
and closes the sockets.

Failure contract: an address that cannot be bound (in use, bad host) raises
`InvalidInputError` at start, naming it. A send that fails is logged and dropped (subscribers
see the gap and replay or resync); nothing here ever blocks or fails the engine. A malformed
replay request is ignored.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import zmq
from zmq.auth.thread import ThreadAuthenticator

from hetserve.config_sections import is_loopback_host, tcp_endpoint
from hetserve.core.block_hash import BlockHash
from hetserve.core.kv_events import (
    MEDIA,
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockStored,
    KVEvent,
    KVEventBatch,
    encode_batch,
)
from hetserve.disagg.kv_wire import END_SEQ, TOPIC, curve_keys, seq_bytes, seq_of
from hetserve.errors import InvalidInputError
from hetserve.kv.events import KVEventRecorder
from hetserve.kv.manager import KVCacheManager
from hetserve.store.api import KVStore

log = logging.getLogger(__name__)

MAX_POOL_MIRROR = 1 << 20  # POOL blocks remembered for snapshots (the pool's evictions are unseen)


class KVEventPublisher:
    def __init__(
        self,
        recorder: KVEventRecorder,
        endpoint: str,
        replay_endpoint: str | None = None,
        token: str | None = None,
        *,
        buffer_batches: int = 10_000,
        interval_s: float = 0.01,
        hwm: int = 100_000,
    ) -> None:
        host, port = tcp_endpoint(endpoint)
        if replay_endpoint is None:  # vLLM's convention: the next port
            replay_endpoint = f"tcp://{host}:{port + 1 if port else 0}"
        replay_host, _ = tcp_endpoint(replay_endpoint)
        loopback = is_loopback_host(host) and is_loopback_host(replay_host)
        if token is None and not loopback:
            raise InvalidInputError(
                f"KV events bound beyond loopback ({endpoint}) need a shared token (--api-key)"
            )
        self.recorder = recorder
        self.token = None if loopback else token  # loopback: plain frames, as vLLM's
        self.interval_s = interval_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._lock = threading.Lock()  # the sequence number and the mirror, read by snapshot()
        self._next_seq = 0
        self._last_ts = 0.0
        self._mirror: dict[str, OrderedDict[bytes, None]] = {m: OrderedDict() for m in MEDIA}
        self.sent_batches = self.failed_batches = self.replays = 0
        try:
            self._pub = self._bind(zmq.PUB, endpoint, hwm)
            self._replay = self._bind(zmq.ROUTER, replay_endpoint, hwm)
        except zmq.ZMQError as exc:
            self._close_sockets()
            msg = f"cannot bind the KV event sockets ({endpoint}, {replay_endpoint}): {exc}"
            raise InvalidInputError(msg) from None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hetserve-kv-events")
        self._thread.start()

    def _bind(self, kind: int, endpoint: str, hwm: int) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(kind)
        sock.linger = 0
        sock.sndhwm = hwm
        if self.token is not None:
            self._secure(sock, self.token)
        host, port = tcp_endpoint(endpoint)
        try:
            sock.bind(f"tcp://{host}:{port or '*'}")
        except zmq.ZMQError:
            sock.close(linger=0)  # else the context's term() waits for it forever
            raise
        return sock

    def _secure(self, sock: zmq.Socket[bytes], token: str) -> None:
        if self._auth is None:  # one ZAP handler per context: it checks every client's key
            client_public, _ = curve_keys(token, "client")
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", _OnlyKey(client_public))
        public, secret = curve_keys(token, "server")
        sock.curve_server = True
        sock.curve_publickey = public
        sock.curve_secretkey = secret

    # ---- callers ---------------------------------------------------------------------------
    def follow(self, store: KVStore, on_saved: list[Callable[[list[BlockHash]], None]]) -> None:
        """Record the KV tiers' blocks too: the store's placements, else the saver's saves."""
        how = self.recorder.attach_tiers(store, on_saved)
        log.info("KV events follow the KV store's %s", how)

    def describe(self) -> dict[str, object]:
        """For /internal/kv_info: where to subscribe and how."""
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": TOPIC,
            "format": "vllm",
            "curve": self.token is not None,
        }

    def snapshot(self) -> tuple[int, float, dict[str, list[bytes]]]:
        """(seq, ts, blocks per medium): what the events up to batch `seq` (-1: none yet; `ts`
        its time stamp) say the instance holds; a subscriber applies the live batches after
        `seq` on top of it."""
        with self._lock:
            blocks = {m: list(held) for m, held in self._mirror.items()}
            return self._next_seq - 1, self._last_ts, blocks

    def close(self, timeout_s: float = 2.0) -> None:
        """Announce that the instance holds nothing, send what is left, close the sockets."""
        if self._stop.is_set():
            return
        self.recorder.cleared()
        self._stop.set()
        self._thread.join(timeout=timeout_s)
        self._close_sockets()

    # ---- the publisher thread -------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(round(self.interval_s * 1000)):
                self._serve_replay()
            self._publish(self.recorder.take())
        self._publish(self.recorder.take())  # the last ones (the close's AllBlocksCleared)

    def _publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        with self._lock:  # a snapshot sees this batch's effect exactly when it sees its seq
            seq = self._next_seq
            self._next_seq += 1
            self._last_ts = ts = time.time()
            self._apply(events)
        payload = encode_batch(KVEventBatch(ts, events, 0))
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart([TOPIC.encode(), seq_bytes(seq), payload], copy=False)
            self.sent_batches += 1
        except zmq.ZMQError as exc:  # subscribers see the gap and replay it from the buffer
            self.failed_batches += 1
            log.warning("KV event batch %d not sent: %s", seq, exc)

    def _apply(self, events: list[KVEvent]) -> None:
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                for m, held in self._mirror.items():
                    if m != MEDIUM_POOL:  # the shared pool outlives the instance
                        held.clear()
                continue
            held = self._mirror[ev.medium or MEDIA[0]]
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    held[h] = None
                    held.move_to_end(h)
                if len(held) > MAX_POOL_MIRROR:
                    for _ in range(len(held) - MAX_POOL_MIRROR):
                        held.popitem(last=False)
            else:
                for h in ev.block_hashes:
                    held.pop(h, None)

    def _serve_replay(self) -> None:
        try:
            frames = self._replay.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        # [identity, b"", start] from REQ (or a DEALER that adds the delimiter), or
        # [identity, start] from a bare DEALER: answer in the same shape.
        if len(frames) not in (2, 3) or len(frames[-1]) != 8 or (len(frames) == 3 and frames[1]):
            log.warning("malformed KV event replay request ignored")
            return
        head, start = frames[:-1], seq_of(frames[-1])
        self.replays += 1
        try:
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart([*head, seq_bytes(seq), payload], copy=False)
            self._replay.send_multipart([*head, END_SEQ, b""])
        except zmq.ZMQError as exc:  # the client went away: nothing to answer
            log.warning("KV event replay not answered: %s", exc)

    def _close_sockets(self) -> None:
        for name in ("_pub", "_replay"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


class _OnlyKey:
    """ZAP credentials: only the client key derived from the shared token may connect."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.key)


def open_publisher(
    kv: KVCacheManager, endpoint: str, replay_endpoint: str | None, token: str | None
) -> KVEventPublisher:
    """The engine's publisher: a recorder on its KV cache, numbering from an
    `AllBlocksCleared` (a restarted instance's subscribers drop what they knew of it)."""
    recorder = KVEventRecorder(kv.block_size)
    recorder.cleared()
    recorder.attach_cache(kv)
    return KVEventPublisher(recorder, endpoint, replay_endpoint, token)
