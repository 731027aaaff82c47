"""Opening an engine's part in prefill/decode disaggregation, by its role.

Called once by `EngineCore.__init__`: a prefill instance gets a `HandoffSender` (the direct
path always; the store path where a shared KV store is configured), a decode instance a
`HandoffReceiver` with its staging area, the direct path's server on `handoff_listen` and, with
a shared store, the store path's poller. An instance of role `both` gets neither: it computes
whole requests, alone or colocated in a cluster.

Failure contract: a receiver bound beyond loopback without a token
(HETSERVE_HANDOFF_TOKEN) is an `InvalidInputError` naming the fix; a port in use is the
OSError of its bind, before the model serves anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetserve import envs
from hetserve.config import DisaggConfig
from hetserve.engine.kv_store import BlockIO
from hetserve.engine.state_io import StateIO
from hetserve.errors import InvalidInputError
from hetserve.kv.handoff import HandoffReceiver, HandoffSender
from hetserve.kv.handoff_direct import DirectPath, DirectReceiver
from hetserve.kv.handoff_mooncake import MooncakePath, register, serve_receiver, start_engine
from hetserve.kv.handoff_paths import Arrivals, Staging, StorePath, StoreReceiver
from hetserve.kv.manager import KVCacheManager
from hetserve.kv.tiers import TierManager
from hetserve.transfer.tcp import is_loopback


@dataclass
class Handoff:
    sender: HandoffSender | None = None
    receiver: HandoffReceiver | None = None
    address: str | None = None  # where the direct path receives, host:port
    paths: tuple[str, ...] = ()  # the hand-off paths it sends or receives over
    _closers: tuple[object, ...] = ()

    def close(self) -> None:
        for c in self._closers:
            c.close()  # type: ignore[attr-defined]


def open_handoff(
    cfg: DisaggConfig,
    kv: KVCacheManager,
    io: BlockIO,
    tiers: TierManager | None,
    state_io: StateIO | None = None,
) -> Handoff:
    shared = tiers is not None and any(t.shared for t in tiers.store.tiers())
    store = tiers.store if (tiers is not None and shared) else None
    token = envs.handoff_token()
    out = Handoff()
    closers: list[object] = []
    host = cfg.handoff_listen.rpartition(":")[0]
    te = start_engine(host) if cfg.handoff_mooncake else None
    if cfg.role.prefills and not cfg.role.decodes:
        direct = DirectPath(token, cfg.handoff_links)
        known = tiers.saver.known if tiers is not None else None
        mooncake = None
        if te is not None:
            if io.on_device:
                raise InvalidInputError(
                    "--handoff-mooncake hands off from host memory here (TCP); with the KV "
                    "cache on an accelerator use --handoff-path direct or store"
                )
            registered = [(t.data_ptr(), t.nbytes) for t in io.tensors]
            for address, nbytes in registered:  # the engine reads the blocks where they are
                register(te, address, nbytes)
            mooncake = MooncakePath(te, token, registered)
        out.sender = HandoffSender(
            kv,
            io,
            StorePath(store) if store is not None else None,
            direct,
            known,
            mooncake,
            state_io,
        )
        closers += [out.sender, direct]
    if cfg.role.decodes and not cfg.role.prefills:
        host, _, port = cfg.handoff_listen.rpartition(":")
        if not is_loopback(host) and not token:
            raise InvalidInputError(
                f"receiving hand-offs on {host} needs a shared token: set HETSERVE_HANDOFF_TOKEN "
                "on every instance (or listen on 127.0.0.1)"
            )
        staging = Staging(cfg.handoff_staging_bytes)
        arrivals = Arrivals(staging)
        server = DirectReceiver(host, int(port), token, arrivals)
        if te is not None:
            serve_receiver(te, host, server)
        poller = StoreReceiver(store, arrivals) if store is not None else None
        capture = tiers.capture_evicted if tiers is not None else None
        out.receiver = HandoffReceiver(kv, io, arrivals, poller, state_io, capture)
        out.address = server.address
        closers += [server, *([poller] if poller else []), staging]
    if out.sender is not None or out.receiver is not None:
        out.paths = ("direct", *(("store",) if store is not None else ()),
                     *(("mooncake",) if te is not None else ()))  # fmt: skip
    out._closers = tuple(closers)
    return out
