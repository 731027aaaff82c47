"""`hetserve bench handoff`: how fast each prefill -> decode hand-off path moves a request's KV,
beside the pool store and this machine's memcpy, measured in the same run.

Each round hands over the same synthetic blocks (`--blocks` x `--block-kb`) by every path, in
rotating order, and times from the sender's first byte to the receiver holding a complete,
checked arrival (what a decode instance waits for): the direct path through shared memory (one
host), the direct path over TCP (1 and `--links` connections, as between hosts) and the shared
pool store (the sender's puts and the receiver's gets) and Mooncake's Transfer Engine
(TCP here; skipped with the reason where it is not installed). Ratios: against the pool (the goal:
direct >= 0.8 of it) and against memcpy of the same bytes (the physical limit here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from hetserve.bench.common import machine_info, print_table, require_at_least, write_json

NAMES = ("direct-shm", "direct-tcp-1", "direct-tcp-n", "store-pool", "mooncake-te")


def register(sub) -> None:
    p = sub.add_parser("handoff", help="prefill -> decode hand-off paths: GB/s side by side")
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--block-kb", type=int, default=1024, help="bytes of one KV block, in KiB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--links", type=int, default=4)
    p.add_argument("--paths", default=",".join(NAMES))
    p.add_argument("--json", "--result-file", dest="json", default=None)
    p.set_defaults(func=run)


def _memcpy_gbs(nbytes: int) -> float:
    import numpy as np

    src = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _arrive(arrivals, key: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = arrivals.take(key)
        if got is not None:
            return got
        time.sleep(0.0002)
    raise RuntimeError(f"hand-off {key} did not arrive")


def _mooncake(receiver, data: memoryview):
    """Two Transfer Engines in this process: the receiver's staging and the sender's bytes
    registered, as two instances would."""
    import ctypes

    from hetserve.kv.handoff_mooncake import MooncakePath, register, serve_receiver, start_engine

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    serve_receiver(start_engine("127.0.0.1"), "127.0.0.1", receiver)
    te = start_engine("127.0.0.1")
    sent = (ctypes.addressof(ctypes.c_char.from_buffer(data.obj)), data.nbytes)
    register(te, *sent)
    return MooncakePath(te, "", [sent])


def run(args: argparse.Namespace) -> int:
    from hetserve.bench.store_peers import local_pool
    from hetserve.errors import InvalidInputError
    from hetserve.kv.handoff_direct import DirectPath, DirectReceiver
    from hetserve.kv.handoff_paths import Arrivals, Manifest, Staging, StorePath, StoreReceiver
    from hetserve.store import open_store

    paths = [p for p in args.paths.split(",") if p]
    bad = [p for p in paths if p not in NAMES]
    if bad or args.blocks < 1 or args.block_kb < 1 or args.rounds < 1:
        raise InvalidInputError(
            f"--paths takes {', '.join(NAMES)}; --blocks, --block-kb, --rounds must be >= 1"
        )
    require_at_least(args, 1, "links")
    bpb = args.block_kb << 10
    nbytes = bpb * args.blocks
    data = memoryview(bytearray(os.urandom(nbytes)))
    blocks = [[data[i * bpb : (i + 1) * bpb]] for i in range(args.blocks)]
    staging = Staging(2 * nbytes + (1 << 20))
    arrivals = Arrivals(staging)
    receiver = DirectReceiver("127.0.0.1", 0, "", arrivals)
    senders = {
        "direct-shm": DirectPath("", 1),
        "direct-tcp-1": DirectPath("", 1, share_memory=False),
        "direct-tcp-n": DirectPath("", args.links, share_memory=False),
    }
    skipped: dict[str, str] = {}
    if "mooncake-te" in paths:
        try:
            senders["mooncake-te"] = _mooncake(receiver, data)
        except Exception as exc:  # not installed, or it would not start: said in the table
            skipped["mooncake-te"] = str(exc).splitlines()[0]
            paths.remove("mooncake-te")
    times: dict[str, list[float]] = {p: [] for p in paths}
    memcpy = _memcpy_gbs(nbytes)
    with local_pool(1, f"{max(256, 3 * nbytes >> 20)}M") as spec:
        store = open_store(spec)
        poller = StoreReceiver(store, arrivals, poll_s=0.0005)
        try:
            for r in range(args.rounds):
                for name in paths[r % len(paths) :] + paths[: r % len(paths)]:
                    key = f"bench-{name}-{r}"
                    # The pool gets fresh block keys each round: nothing is skipped as known.
                    digests = [os.urandom(32).hex() for _ in range(args.blocks)]
                    m = Manifest(key, "00", 16, bpb, 16 * args.blocks, digests)
                    t0 = time.perf_counter()
                    if name == "store-pool":
                        poller.want(key, 60.0)
                        StorePath(store).send(m, blocks, [False] * args.blocks)
                    else:
                        senders[name].send(m, blocks, receiver.address)
                    got = _arrive(arrivals, key)
                    times[name].append(time.perf_counter() - t0)
                    if bytes(staging.view(got.offset, 64)) != bytes(data[:64]):
                        raise RuntimeError(f"{name}: the bytes that arrived are not the ones sent")
                    arrivals.release(got)
        finally:
            poller.close()
            store.close()
            receiver.close()
            staging.close()
    gbs = {p: nbytes / statistics.median(t) / 1e9 for p, t in times.items()}
    pool = gbs.get("store-pool")
    rows = [[p, f"{gbs[p]:.2f}", f"{gbs[p] / pool:.2f}" if pool else "-",
             f"{gbs[p] / memcpy:.2f}"] for p in paths]  # fmt: skip
    print(f"hand-off of {args.blocks} blocks x {args.block_kb} KiB = {nbytes / 1e6:.1f} MB; "
          f"memcpy {memcpy:.1f} GB/s")  # fmt: skip
    rows += [[p, f"- ({why})", "-", "-"] for p, why in skipped.items()]
    print_table(["path", "GB/s (median)", "x pool", "x memcpy"], rows)
    write_json(args.json, {
        "benchmark": "handoff", "machine": machine_info(), "bytes": nbytes,
        "blocks": args.blocks, "block_bytes": bpb, "links": args.links,
        "memcpy_gbs": memcpy, "gbs": gbs,
        "vs_pool": {p: g / pool for p, g in gbs.items()} if pool else None,
        "rounds_s": times, "skipped": skipped,
    })  # fmt: skip
    return 0
