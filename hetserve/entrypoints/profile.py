"""`hetserve profile --out profile.json`: measure this machine's prefill and decode costs for
the model (`disagg/profiler.py`), print the fits with their held-out error, and write the
profile the Conductor and `hetserve sim --hardware` read. With `--through URL --base FILE`:
measure what a running server or cluster adds around the prefill (`disagg/delivery_probe.py`)
and write the base profile with that delivery fit."""

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
    p.add_argument(
        "--through", metavar="URL",
        help="measure the delivery around the prefill through this running server or cluster "
        "(e.g. http://127.0.0.1:8400) instead of an engine; needs --base",
    )  # fmt: skip
    p.add_argument("--base", metavar="FILE", help="with --through: the engine's own profile")
    p.add_argument(
        "--lengths", default="16,256,1024,2048", help="with --through: prompt lengths to probe"
    )
    p.add_argument("--repeats", type=int, default=3, help="with --through: probes per length")
    p.add_argument("--api-key", default=None, help="with --through: the deployment's key")
    p.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from hetserve.entrypoints import check_output

    check_output(args.out, "--out")
    if args.through is not None:
        return _through(args)
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


def _through(args: argparse.Namespace) -> int:
    from hetserve.disagg.costs import load_profile, save_profile
    from hetserve.disagg.delivery_probe import probe
    from hetserve.errors import InvalidInputError

    if args.base is None:
        raise InvalidInputError(
            "--through needs --base PROFILE (the engine's own: hetserve profile --out FILE)",
            param="--base",
        )
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1 or len(set(lengths)) < 2:
        raise InvalidInputError(
            f"--lengths: expected two or more distinct token counts >= 1, got {args.lengths!r}",
            param="--lengths",
        )
    if args.repeats < 1:
        raise InvalidInputError(f"--repeats must be >= 1, got {args.repeats}", param="--repeats")
    try:
        base, raw = load_profile(args.base)
    except ValueError as exc:
        raise InvalidInputError(f"--base: {exc}", param="--base") from None
    print(f"{'tokens':>6} {'TTFT ms':>9} {'prefill ms':>11} {'beyond ms':>10}")

    def show(n: int, ttft: float, predicted: float) -> None:
        print(
            f"{n:>6} {ttft * 1e3:>9.2f} {predicted * 1e3:>11.2f} {(ttft - predicted) * 1e3:>10.2f}"
        )

    profile, _ = probe(args.through, base, lengths, args.repeats, args.api_key, show)
    d = profile.delivery
    assert d is not None
    print(
        f"delivery: {d.overhead_s * 1e3:.2f} ms + {d.per_token_s * 1e6:.2f} us per prompt token "
        f"(mean error {1e3 * (d.fit_error or 0.0):.2f} ms)"
    )
    extra = {k: raw[k] for k in ("capacity", "machine") if k in raw}
    save_profile(args.out, profile, **extra)
    print(f"profile written to {args.out}")
    return 0
