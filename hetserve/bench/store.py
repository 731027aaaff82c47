"""`hetserve bench store`: put/get throughput and latency of KV store backends, per value size,
single and batched, against memcpy on this machine and Mooncake Store over TCP on loopback.

    hetserve bench store --backend local --backend pool --sizes 4K,1M,16M --json out.json

`--backend` takes a spec (`pool://host:port`, `redis://...`) or a shorthand the bench starts for
the run: `local` (in-process DRAM), `pool` (a master and one node on loopback, shared-memory path),
`pool-tcp` (the same, forced over TCP), `redis` (a redis-server on loopback), and
`mooncake-store` / `mooncake-direct` (hetserve's mooncake:// backend on a Mooncake Store on
loopback, gather=stage / gather=direct; rows named `mooncake` are Mooncake's own API).

Goals: pool >= 1.0x Mooncake at 1M and 16M; local DRAM >= 0.5x memcpy. `--parts N` adds rows
where each value lies in N buffers (`bench/store_parts.py`): moved as parts, and gathered by the
caller into one buffer.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np

from hetserve.bench.common import write_json
from hetserve.errors import InvalidInputError

CONTIGUOUS = "1"  # the layout label of one buffer per value
SHORTHANDS = {"local": "local://?dram=2G", "pool": "pool", "pool-tcp": "pool"}


def register(bench_sub) -> None:
    p = bench_sub.add_parser("store", help="KV store put/get GB/s and latency per value size")
    p.add_argument(
        "--backend",
        action="append",
        default=None,
        help="a store spec or a shorthand the bench starts: local, pool, pool-tcp, redis, "
        "mooncake-store, mooncake-direct (repeatable; default local and pool)",
    )
    p.add_argument(
        "--parts",
        type=int,
        default=0,
        help="also move each value as N separate buffers (96: a 48-layer model's KV block)",
    )
    p.add_argument("--sizes", default="4K,1M,16M", help="value sizes, comma separated")
    p.add_argument("--total", default="256M", help="bytes moved per size and mode (bounds ops)")
    p.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake Store peer")
    p.add_argument("--json", "--result-file", dest="json", default=None, help="write JSON here")
    p.set_defaults(func=run)


def _timed(fn: Callable[[], object], n: int, tick: Callable[[], None]) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
        tick()
    return out


def _row(
    backend: str, size: int, mode: str, op: str, lat: list[float], per_call: int, misses: int = 0
) -> dict:
    total = sum(lat)
    lat_ms = sorted(x * 1e3 for x in lat)
    return {
        "backend": backend,
        "size": size,
        "mode": mode,
        "op": op,
        "gbps": per_call * size * len(lat) / total / 1e9,
        "gbps_p50": per_call * size / max(statistics.median(lat), 1e-9) / 1e9,
        "ops_per_s": per_call * len(lat) / total,
        "p50_ms": statistics.median(lat_ms),
        "p99_ms": lat_ms[min(len(lat_ms) - 1, int(0.99 * len(lat_ms)))],
        "misses": misses,
        "layout": CONTIGUOUS,
    }


class Ops:
    """What the bench drives: single and batched put/get of `size`-byte values."""

    def __init__(self, put1, get1, putb, getb, drop=None) -> None:
        self.put1, self.get1, self.putb, self.getb = put1, get1, putb, getb
        # drop(keys): remove what a measurement wrote, so the next one does not measure the
        # store evicting it (or, with Mooncake's read leases, failing to)
        self.drop = drop


def _store_ops(store, size: int, batch: int) -> Ops:
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    dsts = [np.ones(size, dtype=np.uint8) for _ in range(batch)]  # touched: no first-touch faults
    return Ops(
        lambda k: store.put_from(k, src),
        lambda k: store.get_into(k, dsts[0]) == size,
        lambda ks: store.batch_put_from(ks, [src] * len(ks)),
        lambda ks: sum(n == size for n in store.batch_get_into(ks, dsts[: len(ks)])),
        lambda ks: [store.remove(k) for k in ks],
    )


def _measure(
    name: str, variants: list[tuple[str, Ops]], size: int, n: int, batch: int, tick
) -> list[dict]:
    """Rows for each variant (its layout label, its ops). Variants take turns op by op, so a
    neighbour's burst on a shared box slows them alike and their ratio stays fair."""
    tag = uuid.uuid4().hex[:8]
    keys = {p: [f"bench-{tag}-{size}-{p}-{i}" for i in range(n)] for p, _ in variants}
    for p, ops in variants:  # connections, maps and lazy setup are not what we measure
        ops.put1(f"warmup-{tag}-{p}")
        ops.get1(f"warmup-{tag}-{p}")
    groups = {
        p: [[f"{k}-b" for k in ks[i : i + batch]] for i in range(0, n - batch + 1, batch)]
        for p, ks in keys.items()
    }
    m = len(groups[variants[0][0]])
    calls = [  # (mode, op, per call, calls, fn(variant's ops, i) -> hits or None)
        ("single", "put", 1, n, lambda o, p, i: o.put1(keys[p][i])),
        ("single", "get", 1, n, lambda o, p, i: o.get1(keys[p][i])),
        (f"batch{batch}", "put", batch, m, lambda o, p, i: o.putb(groups[p][i])),
        (f"batch{batch}", "get", batch, m, lambda o, p, i: o.getb(groups[p][i])),
    ]
    written = {  # what to drop once a mode's gets are done (halves the peak held)
        "single": lambda p: [f"warmup-{tag}-{p}", *keys[p]],
        f"batch{batch}": lambda p: [k for g in groups[p] for k in g],
    }
    rows = []
    for mode, op, per_call, count, fn in calls:
        lat: dict[str, list[float]] = {p: [] for p, _ in variants}
        hits: dict[str, int] = {p: 0 for p, _ in variants}
        for i in range(count):
            for p, ops in variants:
                t = time.perf_counter()
                got = fn(ops, p, i)
                lat[p].append(time.perf_counter() - t)
                hits[p] += int(got) if op == "get" else 0
                tick()
        for p, ops in variants:
            misses = count * per_call - hits[p] if op == "get" else 0
            rows.append({**_row(name, size, mode, op, lat[p], per_call, misses), "layout": p})
            if op == "get" and ops.drop is not None:
                ops.drop(written[mode](p))
    return rows


def _memcpy(size: int, n: int) -> dict:
    """The copy a get does: from one of n distinct sources (as many bytes as the store run
    holds, so cold in cache once they exceed it) into one destination. Copying one hot buffer
    over and over would measure the cache, not this machine's memcpy."""
    srcs = [np.full(size, i % 251, dtype=np.uint8) for i in range(n)]
    dst = np.ones(size, dtype=np.uint8)
    it = iter(srcs * 2)
    np.copyto(dst, next(it))
    lat = _timed(lambda: np.copyto(dst, next(it)), n, lambda: None)
    return _row("memcpy", size, "single", "copy", lat, 1)


@contextlib.contextmanager
def _open_backend(spec: str) -> Iterator[tuple[str, object]]:
    from hetserve.bench.store_peers import local_mooncake_spec, local_pool, local_redis
    from hetserve.store import open_store

    if spec in ("pool", "pool-tcp"):
        # 3G: removed objects that were read stay leased (5 s) before their space is reused
        with local_pool(nodes=1, dram="3G") as pool_spec:
            suffix = "?shm=0" if spec == "pool-tcp" else ""
            with open_store(pool_spec + suffix) as store:
                yield spec, store
        return
    if spec in ("redis", "mooncake-store", "mooncake-direct"):
        with local_redis() if spec == "redis" else local_mooncake_spec() as started:
            if started is None:
                raise InvalidInputError(f"--backend {spec}: its server is not installed here")
            gather = "&gather=direct" if spec == "mooncake-direct" else ""
            with open_store(started + gather) as store:
                yield spec, store
        return
    with open_store(SHORTHANDS.get(spec, spec)) as store:
        yield spec, store


@contextlib.contextmanager
def _mooncake_ops(size: int, batch: int) -> Iterator[Ops | None]:
    """Mooncake's own zero-copy API (registered buffers, put_from/get_into): its best case."""
    from hetserve.bench.store_peers import local_mooncake

    with local_mooncake() as addr:
        if addr is None:
            yield None
            return
        from mooncake.store import MooncakeDistributedStore

        mc = MooncakeDistributedStore()
        if mc.setup("127.0.0.1", addr[1], 0, 64 << 20, "tcp", "", addr[0]) != 0:
            yield None
            return
        src = np.random.default_rng(0).integers(0, 255, size * batch, dtype=np.uint8)
        dst = np.ones_like(src)
        for buf in (src, dst):
            mc.register_buffer(buf.ctypes.data, buf.nbytes)
        s, d = src.ctypes.data, dst.ctypes.data
        ptrs = [(s + i * size, d + i * size) for i in range(batch)]
        try:
            yield Ops(
                lambda k: _check(mc.upsert_from(k, s, size)),
                lambda k: mc.get_into(k, d, size) == size,
                lambda ks: [
                    _check(r)
                    for r in mc.batch_upsert_from(
                        ks, [p[0] for p in ptrs[: len(ks)]], [size] * len(ks)
                    )
                ],
                lambda ks: sum(
                    r == size
                    for r in mc.batch_get_into(
                        ks, [p[1] for p in ptrs[: len(ks)]], [size] * len(ks)
                    )
                ),
                lambda ks: mc.batch_remove(ks, True),
            )
        finally:
            mc.close()


def _check(rc: int) -> None:
    if rc != 0:
        raise RuntimeError(f"mooncake put failed: {rc}")


def _plan(size: int, total: int) -> tuple[int, int]:
    """(ops, batch size) for one value size: enough ops for percentiles, bounded bytes."""
    n = max(8, min(256, total // size))
    batch = max(2, min(16, (32 << 20) // size))
    return n, min(batch, n)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from hetserve.bench.store_parts import add_layout_ratios, layout_variants
    from hetserve.store.registry import parse_size

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if min(sizes) < 1:
        raise InvalidInputError(f"--sizes: a value is at least 1 byte, got {args.sizes!r}")
    total = parse_size(args.total)
    if total < 1:
        raise InvalidInputError(f"--total: bytes moved per size, at least 1, got {args.total!r}")
    backends = args.backend or ["local", "pool"]
    plans = {size: _plan(size, total) for size in sizes}
    peers = 0 if args.no_mooncake else 1
    per_backend = 3 if args.parts > 1 else 1
    steps = sum(2 * n + 2 * (n // b) for n, b in plans.values())
    steps *= len(backends) * per_backend + peers
    rows: list[dict] = []
    with tqdm(total=steps, desc="bench store", unit="op", leave=False) as bar:
        rows += [_memcpy(size, plans[size][0]) for size in sizes]
        for spec in backends:
            with _open_backend(spec) as (name, store):
                for size in sizes:
                    n, b = plans[size]
                    # memcpy again right before: on a shared box the ratio must compare
                    # numbers taken under the same neighbours' load.
                    ref = _memcpy(size, n)["gbps_p50"]
                    variants = [(CONTIGUOUS, _store_ops(store, size, b))]
                    if args.parts > 1:
                        more = layout_variants(store, size, b, args.parts)
                        drop = variants[0][1].drop
                        variants += [(label, Ops(*fns, drop)) for label, fns in more]
                    measured = _measure(name, variants, size, n, b, bar.update)
                    rows += [{**r, "memcpy_ref_gbps_p50": ref} for r in measured]
        if peers:
            for size in sizes:
                n, b = plans[size]
                with _mooncake_ops(size, b) as ops:
                    if ops is not None:
                        rows += _measure("mooncake", [(CONTIGUOUS, ops)], size, n, b, bar.update)
    _add_ratios(rows)
    add_layout_ratios(rows)
    print("\n" + format_table(rows))
    write_json(args.json, {"bench": "store", "rows": rows, "sizes": sizes})
    return 0


def _add_ratios(rows: list[dict]) -> None:
    """Ratios of median-op throughput, against the memcpy taken just before each backend's
    size: the parts of a run are minutes apart on a shared box, and a neighbour's burst in one
    of them would otherwise swing the ratio."""
    memcpy = {r["size"]: r["gbps_p50"] for r in rows if r["backend"] == "memcpy"}
    peer = {
        (r["size"], r["mode"], r["op"]): r["gbps_p50"] for r in rows if r["backend"] == "mooncake"
    }
    for r in rows:
        ref = r.get("memcpy_ref_gbps_p50") or memcpy.get(r["size"])
        r["vs_memcpy"] = r["gbps_p50"] / ref if ref else None
        ref = peer.get((r["size"], r["mode"], r["op"]))
        r["vs_mooncake"] = r["gbps_p50"] / ref if ref and r["backend"] != "mooncake" else None


def _fmt_size(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'backend':<16}{'size':>6} {'mode':<8}{'parts':>6} {'op':<5}{'GB/s':>8}{'GB/s@p50':>9}"
        f"{'ops/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'xmemcpy':>9}{'xmooncake':>10}{'xcontig':>8}"
        f"{'xstaged':>8}{'miss':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = lambda x: "" if x is None else f"{x:.2f}x"  # noqa: E731
        lines.append(
            f"{r['backend']:<16}{_fmt_size(r['size']):>6} {r['mode']:<8}{r['layout']:>6} "
            f"{r['op']:<5}"
            f"{r['gbps']:>8.2f}{r['gbps_p50']:>9.2f}{r['ops_per_s']:>10.0f}{r['p50_ms']:>9.3f}"
            f"{r['p99_ms']:>9.3f}"
            f"{ratio(r['vs_memcpy']):>9}{ratio(r['vs_mooncake']):>10}"
            f"{ratio(r.get('vs_contiguous')):>8}{ratio(r.get('vs_staged')):>8}{r['misses']:>6}"
        )
    lines.append("GB/s: total bytes / total time; GB/s@p50: per median op (ratios use it)")
    lines.append("goals: pool >= 1.00x mooncake at 1M and 16M; local >= 0.50x memcpy")
    lines.append(
        "parts: 1 one buffer per value; N the value in N buffers (put_parts/get_into_parts);"
    )
    lines.append(
        "       Ns the N buffers gathered by the caller into one and moved as one (xstaged)"
    )
    return "\n".join(lines)
