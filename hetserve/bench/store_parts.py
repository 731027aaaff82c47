"""The multi-part mode of `hetserve bench store` (`--parts N`): each value lies in N buffers, as a
KV block lies in one slice of each layer's K and V tensors (N = 96 for a 48-layer model).

Three layouts are measured side by side: one contiguous buffer (label "1": the ideal, which the
engine's layout cannot have), the N buffers moved with `put_parts` / `get_into_parts` ("N"), and
the N buffers gathered by the caller into one staging buffer and moved with the one-buffer calls
("Ns": what a caller without multi-part calls must do). `xcontig` compares a row with the
contiguous one, `xstaged` the multi-part row with the staged one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

# put1(key), get1(key) -> hit, putb(keys), getb(keys) -> hits: what bench.store.Ops holds
OpFns = tuple[
    Callable[[str], Any],
    Callable[[str], bool],
    Callable[[list[str]], Any],
    Callable[[list[str]], int],
]


def _scatter(src: np.ndarray[Any, Any], parts: list[memoryview]) -> None:
    view, off = memoryview(src), 0  # memoryview slices: the cheapest copy per part in Python
    for p in parts:
        p[:] = view[off : off + p.nbytes]
        off += p.nbytes


def layout_variants(store: Any, size: int, batch: int, parts: int) -> list[tuple[str, OpFns]]:
    cuts = [size * i // parts for i in range(parts + 1)]
    lens = [b - a for a, b in zip(cuts, cuts[1:], strict=False)]
    rng = np.random.default_rng(1)
    # One array per part, as the engine has one tensor per layer: the parts are not adjacent.
    src = [rng.integers(0, 255, n, dtype=np.uint8) for n in lens]
    dsts = [[np.ones(n, dtype=np.uint8) for n in lens] for _ in range(batch)]  # touched
    stage = [np.ones(size, dtype=np.uint8) for _ in range(batch)]
    dst_views = [[memoryview(p) for p in dst] for dst in dsts]

    def put_staged(keys: list[str]) -> None:
        for buf in stage[: len(keys)]:
            np.concatenate(src, out=buf)
        store.batch_put_from(keys, stage[: len(keys)])

    def get_staged(keys: list[str]) -> int:
        got = store.batch_get_into(keys, stage[: len(keys)])
        for buf, dst in zip(stage[: len(keys)], dst_views, strict=False):
            _scatter(buf, dst)
        return sum(n == size for n in got)

    direct: OpFns = (
        lambda k: store.put_parts(k, src),
        lambda k: store.get_into_parts(k, dsts[0]) == size,
        lambda ks: store.batch_put_parts(ks, [src] * len(ks)),
        lambda ks: sum(n == size for n in store.batch_get_into_parts(ks, dsts[: len(ks)])),
    )
    staged: OpFns = (
        lambda k: put_staged([k]),
        lambda k: get_staged([k]) == 1,
        put_staged,
        get_staged,
    )
    return [(str(parts), direct), (f"{parts}s", staged)]


def add_layout_ratios(rows: list[dict[str, Any]]) -> None:
    """`vs_contiguous` for every split layout and `vs_staged` for the multi-part one: median-op
    GB/s over the same backend's row (same size, mode and op) in the other layout."""
    by = {(r["backend"], r["size"], r["mode"], r["op"], r["layout"]): r["gbps_p50"] for r in rows}
    for r in rows:
        at = (r["backend"], r["size"], r["mode"], r["op"])
        contiguous = by.get((*at, "1"))
        split = r["layout"] != "1"
        r["vs_contiguous"] = r["gbps_p50"] / contiguous if split and contiguous else None
        staged = by.get((*at, r["layout"] + "s"))
        r["vs_staged"] = r["gbps_p50"] / staged if staged else None
