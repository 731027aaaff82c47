"""The KV event transport's conventions, shared by the publisher and its subscribers.

Frames, as vLLM's `ZmqEventPublisher` sends them: on the PUB socket `[topic, seq, payload]`,
`seq` an 8-byte big-endian counter from 0, `payload` one encoded `KVEventBatch`
(`core/kv_events.py`). Replay, on a ROUTER socket: a client sends its first missing `seq` as 8
big-endian bytes (after the empty delimiter a REQ socket adds), and is answered with one
`[seq, payload]` message per batch still buffered from there on, then `[END_SEQ, b""]`. A REQ
socket accepts only the first of those messages (libzmq drops replies after the first), so our
subscriber asks from a DEALER that sends the same delimiter.

Security: beyond loopback both sockets run CURVE (encrypted, and only clients holding the
shared token may connect), with both key pairs derived from the token, so nothing else has to
be handed out. A token frame would have changed vLLM's frame layout for every consumer;
CURVE leaves the frames as they are. On loopback there is no security (as /v1 without a key).
"""

from __future__ import annotations

import hashlib

import zmq
from zmq.utils import z85

TOPIC = "kv-events"  # vLLM's example subscriber filters on it; an empty filter takes it too
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay
WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")  # bound on every interface


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


def curve_keys(token: str, role: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 CURVE keys of `role` ("server" or "client") for this token."""
    seed = hashlib.sha256(f"hetserve-kv-events/{role}\0{token}".encode()).digest()
    secret = z85.encode(seed)  # any 32 bytes are a Curve25519 secret key (clamped by libsodium)
    return zmq.curve_public(secret), secret


def secure_client(sock: zmq.Socket[bytes], token: str) -> None:
    """Make `sock` a CURVE client of a publisher that holds the same token (before connect)."""
    server_public, _ = curve_keys(token, "server")
    public, secret = curve_keys(token, "client")
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret
