"""`hetserve sim`: replay a request trace on a simulated cluster through the Conductor's own
policy code (`hetserve.disagg.policy`), at any scale, on this machine.

Prints one table row per run (every --policy x --admission x --cache x --rate-sweep x
--cache-sweep), the digital-twin comparison when the trace is a request log with measurements,
and the cheapest mix under --search; --json and --plot write the same. Bad options and bad
traces are one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hetserve.errors import InvalidInputError

if TYPE_CHECKING:
    from hetserve.sim.run import Plan, Run

    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

POLICIES = ("random", "round-robin", "load", "cache-aware", "tier-credit", "kvcentric")
ADMISSIONS = ("none", "threshold", "predictive")


def register(sub: Subparsers) -> None:
    p = sub.add_parser("sim", help="cluster simulator: a trace through the Conductor's policy")
    p.add_argument("--trace", help="Mooncake trace or hetserve request log (JSON lines)")
    c = p.add_argument_group("cluster")
    c.add_argument("--prefill", default="8", help="N or N:HARDWARE[,M:HARDWARE] (default 8)")
    c.add_argument("--decode", default="8", help="as --prefill (default 8)")
    c.add_argument(
        "--hardware",
        default="llama3-70b-a800",
        help="preset or profile.json for bare counts (default llama3-70b-a800)",
    )
    c.add_argument("--cache-nodes", default=None, help="CPU nodes lending DRAM to the pool")
    c.add_argument("--price", default=None, help="NAME=USD per hour, comma-separated")
    c.add_argument("--list-hardware", action="store_true", help="print the presets and exit")
    s = p.add_argument_group("scheduling")
    s.add_argument("--policy", default="kvcentric", help=f"one or more of {', '.join(POLICIES)}")
    s.add_argument("--admission", default="none", help=f"one or more of {', '.join(ADMISSIONS)}")
    s.add_argument("--cache", default="global", help="local, global, or both as local,global")
    s.add_argument(
        "--cache-tokens-per-instance",
        type=int,
        default=None,
        help="DRAM KV cache per prefill instance (default: the hardware's)",
    )
    s.add_argument("--cache-sweep", default=None, help="cache sizes in tokens, comma-separated")
    s.add_argument(
        "--block-tokens",
        type=int,
        default=None,
        help="cache block (default: the trace's; a multiple of it)",
    )
    s.add_argument("--slo", default="ttft=30s,tbt=100ms", help="or none")
    s.add_argument(
        "--no-forecast",
        action="store_true",
        help="the decode side's load now, not at the request's arrival there",
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply trace timestamps (0.5 replays twice as fast)",
    )
    w.add_argument("--rate-sweep", default=None, help="arrival rates, x the trace's (0.5,1,2)")
    w.add_argument("--output-tokens", type=int, default=None, help="every request's output")
    w.add_argument("--limit", type=int, default=None, help="the first N requests only")
    w.add_argument("--seed", type=int, default=0, help="the random policy's seed")
    o = p.add_argument_group("output")
    o.add_argument("--search", default=None, help="prefill=MIN-MAX,decode=MIN-MAX")
    o.add_argument(
        "--goal", type=float, default=None, help="--search: effective share to meet (0.99)"
    )
    o.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    o.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots here")
    o.add_argument(
        "--log-decisions",
        default=None,
        metavar="FILE",
        help="the first run's views and decisions, for replay",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.list_hardware:
        return _list_hardware()
    from hetserve.entrypoints import check_output

    check_output(args.plot, "--plot", directory=True)
    check_output(args.log_decisions, "--log-decisions")
    check_output(args.json, "--json", make_parent=True)
    if args.goal is not None and not args.search:
        raise InvalidInputError("--goal is the share --search must meet; give --search too")
    goal = 0.99 if args.goal is None else args.goal
    if not 0 < goal <= 1:
        raise InvalidInputError("--goal must be in (0, 1]", param="--goal")
    t0 = time.perf_counter()
    plan = _plan(args)
    payload: dict[str, Any] = {
        "trace": args.trace,
        "requests": len(plan.records),
        "prefill": _pool_names(plan.prefill),
        "decode": _pool_names(plan.decode),
        "slo": {"ttft_s": plan.slo_ttft_s, "tbt_s": plan.slo_tbt_s},
    }
    if args.search:
        from hetserve.sim.options import search_ranges
        from hetserve.sim.search import search

        payload["search"] = search(plan, search_ranges(args.search), goal)
        _print_search(payload["search"])
    else:
        runs = _runs(plan, args)
        payload["runs"] = [r.row() for r in runs]
        sim_wall = sum(r.summary["wall_s"] for r in runs)
        events = sum(r.summary["events"] for r in runs)
        policy = sum(r.summary["policy_s"] for r in runs)
        payload |= {
            "sim_wall_s": sim_wall,
            "events": events,
            "events_per_s": events / sim_wall if sim_wall > 0 else None,
            "policy_s": policy,
            "policy_share": policy / sim_wall if sim_wall > 0 else None,
        }
        busy = max(sim_wall, 1e-9)
        print(
            f"{len(runs)} run(s) of {len(plan.records)} requests: {sim_wall:.2f} s simulating, "
            f"{events / busy:,.0f} events/s, {100 * policy / busy:.0f}% in the policy's decide"
        )
        if args.plot:
            from hetserve.sim.plots import write_plots

            for path in write_plots(args.plot, runs):
                print(f"wrote {path}")
    payload["wall_s"] = time.perf_counter() - t0
    print(f"wall {payload['wall_s']:.2f} s")
    if args.json:
        _write_json(args.json, payload)
    return 0


def _plan(args: argparse.Namespace) -> Plan:
    from hetserve.sim import options as opt
    from hetserve.sim.run import Plan
    from hetserve.sim.trace import read_cluster_logs, read_trace

    if not args.trace:
        raise InvalidInputError("--trace is required (or --list-hardware)", param="--trace")
    for name in ("cache_tokens_per_instance", "block_tokens", "output_tokens", "limit"):
        value, least = getattr(args, name), 0 if name == "cache_tokens_per_instance" else 1
        if value is not None and value < least:
            flag = "--" + name.replace("_", "-")
            raise InvalidInputError(f"{flag} must be >= {least}, got {value}", param=flag)
    if not args.time_scale > 0:
        raise InvalidInputError("--time-scale must be > 0", param="--time-scale")
    if Path(args.trace).is_dir():  # a cluster's request logs, joined
        records = read_cluster_logs(args.trace)[: args.limit]
    else:
        records = read_trace(args.trace)[: args.limit]
        if any(r.handoff_tokens for r in records):
            raise InvalidInputError(
                f"--trace {args.trace} is a decode instance's log (its prompts' KV came from a "
                "prefill instance): replay the cluster's log directory (`cluster up "
                "--log-requests DIR`) or the Conductor's log",
                param="--trace",
            )
    price = opt.prices(args.price)
    cache_tokens = args.cache_tokens_per_instance
    ttft, tbt = opt.slo(args.slo)
    sweep = opt.numbers(args.cache_sweep, "--cache-sweep") if args.cache_sweep else None
    block = args.block_tokens or records[0].block_size
    if block % records[0].block_size:
        raise InvalidInputError(
            f"--block-tokens {block} must be a multiple of the trace's {records[0].block_size}",
            param="--block-tokens",
        )
    prefill = opt.pool(args.prefill, "--prefill", args.hardware, price, cache_tokens)
    decode = opt.pool(args.decode, "--decode", args.hardware, price, cache_tokens)
    nodes = opt.cache_nodes(args.cache_nodes, price)
    opt.check_prices(price, [hw.name for p in (prefill, decode) for _, hw in p.groups]
                     + [n.name for n in nodes])  # fmt: skip
    plan = Plan(
        records=records,
        prefill=prefill,
        decode=decode,
        cache_nodes=nodes,
        policies=opt.choices(args.policy, POLICIES, "--policy"),
        admissions=opt.choices(args.admission, ADMISSIONS, "--admission"),
        caches=opt.choices(args.cache, ("local", "global"), "--cache"),
        rates=opt.numbers(args.rate_sweep, "--rate-sweep") if args.rate_sweep else (1.0,),
        cache_tokens=[int(x) for x in sweep] if sweep else (None,),
        block_tokens=block,
        slo_ttft_s=ttft,
        slo_tbt_s=tbt,
        time_scale=args.time_scale,
        output_tokens=args.output_tokens,
        forecast=not args.no_forecast,
        seed=args.seed,
        replicas=bool(args.plot or args.json),
    )
    if not plan.prefill.instances() or not plan.decode.instances():
        raise InvalidInputError("--prefill and --decode need at least one instance each")
    return plan


def _runs(plan: Plan, args: argparse.Namespace) -> list[Run]:
    from hetserve.sim.run import run_all

    if args.log_decisions:
        _log_decisions(plan, args.log_decisions)
    runs = run_all(plan)
    _print_runs(runs)
    for run in runs:
        if run.twin is not None:
            _print_twin(run)
    return runs


def _log_decisions(plan: Plan, path: str) -> None:
    from hetserve.sim.decisions import DecisionLog
    from hetserve.sim.run import config, simulate

    cfg = config(plan, plan.policies[0], plan.admissions[0], plan.caches[0], plan.rates[0])
    log = DecisionLog(path, cfg.router)
    try:
        simulate(plan, cfg, log.record)
    finally:
        log.close()
    print(f"wrote {path}")


def _print_runs(runs: list[Run]) -> None:
    from hetserve.bench.common import print_table

    headers = [
        "policy",
        "admission",
        "cache",
        "rate",
        "cache tok",
        "hit %",
        "pool %",
        "prefill s",
        "TTFT s",
        "p50",
        "p90",
        "p99",
        "TBT ms",
        "p90",
        "p99",
        "effective %",
        "rej adm",
        "rej dec",
        "good/$",
    ]
    rows = []
    for run in runs:
        p, s = run.params, run.summary
        t, b = s["ttft_s"], s["tbt_s"]
        ms = [None if b[k] is None else 1000 * b[k] for k in ("mean", "p90", "p99")]
        rows.append(
            [
                p["policy"],
                p["admission"],
                p["cache"],
                p["rate"],
                p["cache_tokens"],
                100 * s["cache_hit_rate"],
                100 * s["pool_hit_rate"],
                s["prefill_compute_s"],
                t["mean"],
                t["p50"],
                t["p90"],
                t["p99"],
                *ms,
                100 * s["effective_ratio"],
                s["rejected_admission"],
                s["rejected_decode"],
                s["goodput_per_dollar"],
            ]
        )
    print_table(headers, rows)


def _print_twin(run: Run) -> None:
    t = run.twin or {}
    parts = []
    if "ttft_measured_s" in t:
        err = t["ttft_error"]
        parts.append(
            f"mean TTFT predicted {t['ttft_predicted_s']:.3f} s, measured "
            f"{t['ttft_measured_s']:.3f} s ({'n/a' if err is None else f'{100 * err:+.1f}%'})"
        )
    if "reuse_measured" in t:
        parts.append(
            f"prefix reuse predicted {100 * t['reuse_predicted']:.1f}%, measured "
            f"{100 * t['reuse_measured']:.1f}% ({t['reuse_diff_pp']:+.1f} pp)"
        )
    print(f"digital twin ({run.params['policy']}, {run.params['cache']}): " + "; ".join(parts))


def _print_search(result: dict[str, Any]) -> None:
    from hetserve.bench.common import print_table

    rows = [
        [
            r["prefill"],
            r["decode"],
            r["cost_per_hour"],
            100 * r["effective_ratio"],
            r["ttft_mean_s"],
            r["goodput_per_dollar"],
            "yes" if r["meets_goal"] else "no",
        ]
        for r in result["evaluated"]
    ]
    unit = "$/h" if result["priced"] else "instances"
    print_table(["prefill", "decode", unit, "effective %", "TTFT s", "good/$", "meets"], rows)
    best = result["cheapest"]
    goal = 100 * result["goal"]
    if best is None:
        print(f"no mix in the range serves {goal:g}% of the requests within the SLOs")
    else:
        print(
            f"cheapest mix serving >= {goal:g}% within the SLOs: {best['prefill']} x "
            f"{result['prefill_hardware']} + {best['decode']} x {result['decode_hardware']} "
            f"({best['cost_per_hour']:g} {unit})"
        )


def _pool_names(pool: Any) -> list[str]:
    return [f"{n} x {hw.name}" for n, hw in pool.groups]


def _list_hardware() -> int:
    from hetserve.bench.common import print_table
    from hetserve.sim.hardware import CACHE_NODES, PRESETS

    rows = []
    for name, make in PRESETS.items():
        hw = make()
        p = hw.profile
        rows.append(
            [
                name,
                p.prefill.seconds(8192),
                1000 * p.decode.seconds(32, 32 * 8192),
                p.kv_bytes_per_token,
                hw.host_cache_tokens,
                hw.device_kv_tokens,
                hw.price_per_hour,
            ]
        )
    print_table(
        [
            "preset",
            "prefill 8k s",
            "step b32 ms",
            "KV B/token",
            "DRAM cache tok",
            "device KV tok",
            "$/h",
        ],
        rows,
    )
    for node in CACHE_NODES.values():
        print(
            f"cache node {node.name}: {node.dram_bytes / 2**40:g} TiB DRAM, "
            f"${node.price_per_hour:g}/h"
        )
    print("sources and assumptions: the docstrings in hetserve/sim/hardware.py")
    return 0


def _write_json(path: str, payload: dict[str, Any]) -> None:
    machine = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "argv": sys.argv[1:],
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, **payload}, indent=2) + "\n")
    print(f"wrote {out}")
