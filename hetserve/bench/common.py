"""Shared pieces of the benchmarks: result tables, JSON output, the common CLI options."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path


class Unavailable(Exception):
    """A system or peer that cannot run here; the message says why (one line)."""


def machine_info() -> dict:
    import torch  # here, not at the top: the HTTP benches (and their poller processes) need none

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "native_isa": native_isa(),
    }
    return info


def native_isa() -> str | None:
    """The instruction set hetserve's native kernels run here (None where they cannot):
    results from an AVX2 machine and an AVX-512 one are not comparable."""
    from hetserve import native

    if native.native_unavailable_reason() is not None:
        return None
    return native.isa()


def print_table(headers: list[str], rows: list[list]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return "-" if value is None else str(value)


def add_server_args(p) -> None:
    """The options of every bench that talks to a running server over HTTP."""
    p.add_argument("--url", "--base-url", dest="url", required=True,
                   help="server root, e.g. http://127.0.0.1:8000")  # fmt: skip
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")


def require_at_least(args, minimum: int, *names: str) -> None:
    """A user error naming the first of the options `names` (argparse dests) set below
    `minimum`, before anything loads: a count of 0 timed nothing (a rate of 0, an empty median)
    and a size of 0 divided by it. An option left unset (None) passes."""
    from hetserve.errors import InvalidInputError

    for name in names:
        value = getattr(args, name)
        if value is not None and value < minimum:
            flag = "--" + name.replace("_", "-")
            raise InvalidInputError(f"{flag} must be >= {minimum}, got {value}")


def write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2))
    print(f"wrote {out}")


def best_time(fn: Callable[[], object], repeats: int, bar=None) -> float:
    """Best wall time of `repeats` calls (the least disturbed by a shared machine)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if bar is not None:
            bar.update(1)
    return best


def decode_rate(
    make_run: Callable[[int], Callable[[], object]], tokens: int, repeats: int, bar=None
) -> float:
    """(N - 1) / (t(N) - t(1)): prefill and per-call overhead cancel out. `make_run(n)` returns
    a call generating n tokens; 2 + 2 * repeats calls are made."""
    make_run(2)()  # warm-up: kernels compiled, pools allocated
    t1 = best_time(make_run(1), repeats, bar)
    tn = best_time(make_run(tokens), repeats, bar)
    if tn <= t1 * 1.05:
        # Too few tokens to separate decode from noise (tiny models, busy machine): the
        # end-to-end rate is a lower bound, never a division by ~0.
        return tokens / tn
    return (tokens - 1) / (tn - t1)


def decode_run_fields(args, threads: int) -> dict:
    """The settings a decode bench's JSON opens with (bench decode, bench decode --streams)."""
    return {"model": str(args.model), "tokens": args.tokens, "prompt_len": args.prompt_len,
            "repeats": args.repeats, "rounds": args.rounds, "threads": threads}  # fmt: skip


def model_dir(args) -> str:
    """The checkpoint directory behind --model (the demo model when none is given), for the
    peers that load the same files."""
    from hetserve.engine.setup import resolve_model_dir

    return str(resolve_model_dir(args.model))
