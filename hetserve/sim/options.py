"""The values of `hetserve sim`'s options, parsed and checked: one `InvalidInputError` naming
the option for anything malformed (the CLI prints it as one line and exits 2).

- pools: `--prefill 8`, `--prefill 4:llama3-70b-h800,2:deepseek-v3-ktransformers`, the same for
  `--decode`; a bare count takes `--hardware`; `--cache-nodes 2:xeon-kvcache`;
- `--slo ttft=30s,tbt=100ms` (units s or ms, default s);
- lists: `--policy kvcentric,random`, `--rate-sweep 0.5,1,2`, `--cache-sweep 1e6,3e6`;
- `--price llama3-70b-h20=18.5,xeon-kvcache=3`;
- `--search prefill=1-16,decode=1-16`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from hetserve.errors import InvalidInputError
from hetserve.sim.hardware import CACHE_NODES, CacheNode, Hardware, resolve, with_overrides


def _bad(param: str, msg: str) -> InvalidInputError:
    return InvalidInputError(f"{param}: {msg}", param=param)


def split_list(text: str, param: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise _bad(param, "expected a comma-separated list")
    return items


def choices(text: str, allowed: Sequence[str], param: str) -> list[str]:
    items = split_list(text, param)
    for item in items:
        if item not in allowed:
            raise _bad(param, f"{item!r}: choose from {', '.join(allowed)}")
    return items


def numbers(text: str, param: str, positive: bool = True) -> list[float]:
    out = []
    for item in split_list(text, param):
        try:
            x = float(item)
        except ValueError:
            raise _bad(param, f"{item!r} is not a number") from None
        if not math.isfinite(x) or (positive and x <= 0):
            raise _bad(param, f"{item!r} must be a finite number > 0")
        out.append(x)
    return out


def slo(text: str) -> tuple[float | None, float | None]:
    """`ttft=30s,tbt=100ms` -> (30.0, 0.1); `none` -> (None, None)."""
    if text.strip().lower() == "none":
        return None, None
    found: dict[str, float] = {}
    for item in split_list(text, "--slo"):
        key, sep, value = item.partition("=")
        if not sep or key not in ("ttft", "tbt"):
            raise _bad("--slo", f"{item!r}: expected ttft=VALUE or tbt=VALUE (e.g. ttft=30s)")
        scale = 1e-3 if value.endswith("ms") else 1.0
        digits = value.removesuffix("ms").removesuffix("s")
        try:
            seconds = float(digits) * scale
        except ValueError:
            raise _bad("--slo", f"{item!r}: {value!r} is not a time (30s, 100ms)") from None
        if not (seconds > 0 and math.isfinite(seconds)):
            raise _bad("--slo", f"{item!r} must be > 0")
        found[key] = seconds
    return found.get("ttft"), found.get("tbt")


def prices(text: str | None) -> dict[str, float]:
    if not text:
        return {}
    out = {}
    for item in split_list(text, "--price"):
        name, sep, value = item.partition("=")
        try:
            out[name] = float(value) if sep else math.nan
        except ValueError:
            out[name] = math.nan
        if not sep or not (out[name] >= 0):
            raise _bad("--price", f"{item!r}: expected NAME=USD_PER_HOUR")
    return out


def check_prices(price: Mapping[str, float], names: list[str]) -> None:
    """A price for hardware the run does not use is a typo, not a no-op."""
    unused = [name for name in price if name not in names]
    if unused:
        known = ", ".join(dict.fromkeys(names))
        raise _bad("--price", f"{unused[0]!r} is no hardware in this run ({known})")


@dataclass(frozen=True)
class Pool:
    """One role's instances: (count, hardware) groups, in order."""

    groups: tuple[tuple[int, Hardware], ...]

    def instances(self) -> list[Hardware]:
        return [hw for n, hw in self.groups for _ in range(n)]

    def with_count(self, n: int) -> Pool:
        (_, hw), *rest = self.groups
        assert not rest, "a search varies a pool of one hardware"
        return Pool(((n, hw),))


def pool(
    text: str,
    param: str,
    default_hw: str,
    price: Mapping[str, float],
    cache_tokens: int | None,
    loader: Callable[[str], Hardware] = resolve,
) -> Pool:
    groups = []
    for item in split_list(text, param):
        count, _, name = item.partition(":")
        n = _count(count, param, item)
        hw = with_overrides(loader(name or default_hw), cache_tokens, None)
        groups.append((n, with_overrides(hw, None, price.get(hw.name))))
    return Pool(tuple(groups))


def cache_nodes(text: str | None, price: Mapping[str, float]) -> list[CacheNode]:
    if not text:
        return []
    out = []
    for item in split_list(text, "--cache-nodes"):
        count, _, name = item.partition(":")
        n = _count(count, "--cache-nodes", item)
        node = CACHE_NODES.get(name or "xeon-kvcache")
        if node is None:
            raise _bad("--cache-nodes", f"{name!r}: choose from {', '.join(CACHE_NODES)}")
        if node.name in price:
            node = replace(node, price_per_hour=price[node.name])
        out += [node] * n
    return out


def _count(text: str, param: str, item: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise _bad(param, f"{item!r}: expected COUNT or COUNT:HARDWARE") from None
    if n < 0:
        raise _bad(param, f"{item!r}: the count must be >= 0")
    return n


def search_ranges(text: str) -> dict[str, range]:
    """`prefill=1-16,decode=2-8` -> {"prefill": range(1, 17), "decode": range(2, 9)}."""
    out = {}
    for item in split_list(text, "--search"):
        role, sep, span = item.partition("=")
        lo, dash, hi = span.partition("-")
        try:
            a, b = int(lo), int(hi if dash else lo)
        except ValueError:
            a = b = -1
        if role not in ("prefill", "decode") or not sep or a < 1 or b < a:
            raise _bad("--search", f"{item!r}: expected prefill=MIN-MAX or decode=MIN-MAX")
        out[role] = range(a, b + 1)
    return out
