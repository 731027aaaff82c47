"""The hand-off through Mooncake's Transfer Engine (`mooncake-transfer-engine`, the library
vLLM's and SGLang's Mooncake connectors use): TCP here, RDMA where the hosts have it.

Who calls it: `engine/handoff.py` when an instance is started with `--handoff-mooncake`. A
decode instance registers its staging segment with its engine and tells senders, in the direct
path's OPEN reply, its session (host:rpc_port) and the segment's address; a prefill instance
registers its KV tensors, so the engine reads the blocks where they are and writes them straight
into the receiver's staging (`batch_transfer_sync_write`), then commits over the direct path's
control connection like any other push.

Failure contract: an engine that will not start or register is a `HandoffError` naming why at
start-up; a transfer that fails is a `HandoffError` (the decode side recomputes).
"""

from __future__ import annotations

import ctypes
from dataclasses import asdict
from typing import Any

import numpy as np

from hetserve.kv.handoff_direct import COMMIT, OPEN, DirectReceiver, _split
from hetserve.kv.handoff_paths import Blocks, HandoffError, Manifest
from hetserve.transfer.tcp import FrameClient


def start_engine(host: str) -> Any:
    """A Transfer Engine on `host` in peer-to-peer mode (no metadata server)."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError:
        raise HandoffError(
            "--handoff-mooncake needs Mooncake's transfer engine: pip install 'hetserve[mooncake]'"
        ) from None
    te = TransferEngine()
    if te.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise HandoffError(f"Mooncake's transfer engine did not start on {host}")
    return te


def register(te: Any, address: int, nbytes: int) -> None:
    if te.register_memory(address, nbytes) != 0:
        raise HandoffError(f"Mooncake could not register {nbytes} bytes at {address:#x}")


def serve_receiver(te: Any, host: str, receiver: DirectReceiver) -> None:
    """Let senders write into `receiver`'s staging through `te`."""
    seg = receiver.arrivals.staging.segment
    base = ctypes.addressof(ctypes.c_char.from_buffer(seg.map))
    register(te, base, seg.size)
    receiver.transfer_engine = {"session": f"{host}:{te.get_rpc_port()}", "base": base}
    receiver.keep_alive = te  # the engine serves its port for as long as it lives


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class MooncakePath:
    name = "mooncake"

    def __init__(self, te: Any, token: str, registered: list[tuple[int, int]]) -> None:
        """`registered`: (address, bytes) of the memory registered with `te` at start-up (the
        KV tensors); a part outside it (a linear-attention state's snapshot) is registered for
        the transfer and unregistered after it, as RDMA needs of every source."""
        self.te, self.token, self.registered = te, token, registered

    def _inside(self, address: int, nbytes: int) -> bool:
        return any(a <= address and address + nbytes <= a + n for a, n in self.registered)

    def send(self, manifest: Manifest, blocks: Blocks, peer: str) -> None:
        extra = {
            (_address(p), p.nbytes)
            for parts in blocks
            for p in parts
            if p.nbytes and not self._inside(_address(p), p.nbytes)
        }
        done: list[int] = []
        try:
            for address, nbytes in extra:
                register(self.te, address, nbytes)
                done.append(address)
            self._send(manifest, blocks, peer)
        finally:
            for address in done:
                self.te.unregister_memory(address)

    def _send(self, manifest: Manifest, blocks: Blocks, peer: str) -> None:
        host, port = _split(peer)
        control = FrameClient(host, port, self.token)
        try:
            opening = {"key": manifest.key, "bytes": manifest.nbytes, "te": True}
            meta, _ = control.call(OPEN, opening)
            te = meta.get("te")
            if not isinstance(te, dict):
                raise HandoffError(f"{peer} does not receive through Mooncake")
            at = int(te["base"]) + int(meta["offset"])
            srcs, dsts, lens = [], [], []
            for parts in blocks:
                for p in parts:
                    srcs.append(_address(p))
                    dsts.append(at)
                    lens.append(p.nbytes)
                    at += p.nbytes
            if srcs and self.te.batch_transfer_sync_write(te["session"], srcs, dsts, lens) != 0:
                raise HandoffError(f"Mooncake's transfer to {te['session']} failed")
            stripes = [0] if blocks else []
            commit = {"manifest": asdict(manifest), "stripes": stripes, "copied": stripes}
            control.call(COMMIT, commit)
        finally:
            control.close()
