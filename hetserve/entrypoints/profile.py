"""`hetserve profile --out profile.json`: measure this machine's prefill and decode costs for
the model (`disagg/profiler.py`), print the fits with their held-out error, and write the
profile the Conductor and `hetserve sim --hardware` read."""

from __future__ import annotations

import argparse
import sys

from hetserve.config import add_engine_args


def register(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="measure prefill/decode costs of a model here (for the Conductor and the simulator)",
        description=__doc__,
    )
    add_engine_args(p)
    p.add_argument("--out", required=True, metavar="FILE", help="where to write the profile")
    p.add_argument("--quick", action="store_true", help="fewer points (seconds, less exact)")
    p.add_argument(
        "--keep-samples", action="store_true", help="store the raw samples in the profile too"
    )
    p.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from hetserve.config import EngineConfig
    from hetserve.disagg.costs import fit_error, save_profile
    from hetserve.disagg.profiler import Plan, capacity, measure
    from hetserve.engine.core import EngineCore

    engine = EngineCore(EngineConfig.from_args(args))
    try:
        plan = Plan.quick() if args.quick else Plan()
        profile, samples = measure(engine, plan, lambda s: print(f"  {s}", file=sys.stderr))
        cap = capacity(engine, profile)
    finally:
        engine.close()
    print(f"{'kind':8} {'a':>6} {'b':>8} {'measured ms':>12} {'fitted ms':>10}")
    for new, cached, s in samples.prefill:
        fit = profile.prefill.seconds(new, cached)
        print(f"{'prefill':8} {new:>6} {cached:>8} {s * 1e3:>12.2f} {fit * 1e3:>10.2f}")
    for batch, ctx, s in samples.decode:
        fit = profile.decode.seconds(batch, ctx)
        print(f"{'decode':8} {batch:>6} {ctx:>8} {s * 1e3:>12.2f} {fit * 1e3:>10.2f}")
    on_all = fit_error(profile.prefill, samples.prefill)
    print(
        f"prefill fit error (held out) {_pct(profile.prefill_fit_error)}, on all samples "
        f"{_pct(on_all)}; decode {_pct(profile.decode_fit_error)}"
    )
    extra: dict = {"capacity": cap}
    if args.keep_samples:
        extra["samples"] = {"prefill": samples.prefill, "decode": samples.decode}
    save_profile(args.out, profile, **extra)
    print(f"profile written to {args.out}")
    return 0


def _pct(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{x * 100:.1f}%"
