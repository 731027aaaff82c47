"""`--search`: which mix of prefill and decode instances serves the trace cheapest while
meeting its SLOs.

A mix qualifies when its share of effective requests (both SLOs met) reaches `goal`. For each
prefill count, the fewest decode instances that qualify are found by bisection (more decode
instances never make a run worse: the share is taken as monotone in them), and a prefill count
whose instances alone cost more than the best mix found stops the search. Cost is the price
per hour of every instance (and of the pool's CPU nodes); with no prices known, the instance
count stands in.

Who calls it: the CLI. Each evaluated mix is one full simulation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hetserve.sim.metrics import summarize
from hetserve.sim.run import Plan, config, simulate


def search(
    plan: Plan,
    ranges: dict[str, range],
    goal: float,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    pre_hw, dec_hw = plan.prefill.groups[0][1], plan.decode.groups[0][1]
    priced = pre_hw.price_per_hour > 0 or dec_hw.price_per_hour > 0
    nodes = sum(n.price_per_hour for n in plan.cache_nodes) if "global" in plan.caches else 0.0

    def cost(p: int, d: int) -> float:
        if not priced:
            return float(p + d)
        return p * pre_hw.price_per_hour + d * dec_hw.price_per_hour + nodes

    p_range = ranges.get("prefill", range(plan.prefill.groups[0][0], plan.prefill.groups[0][0] + 1))
    d_range = ranges.get("decode", range(plan.decode.groups[0][0], plan.decode.groups[0][0] + 1))
    seen: dict[tuple[int, int], dict[str, Any]] = {}

    def evaluate(p: int, d: int) -> bool:
        if (p, d) not in seen:
            cfg = config(
                plan,
                plan.policies[0],
                plan.admissions[0],
                plan.caches[0],
                prefill=plan.prefill.with_count(p),
                decode=plan.decode.with_count(d),
            )
            s = summarize(simulate(plan, cfg))
            seen[(p, d)] = {
                "prefill": p,
                "decode": d,
                "cost_per_hour": cost(p, d),
                "effective_ratio": s["effective_ratio"],
                "goodput_per_dollar": s["goodput_per_dollar"],
                "ttft_mean_s": s["ttft_s"]["mean"],
                "tbt_p90_s": s["tbt_s"]["p90"],
                "meets_goal": s["effective_ratio"] >= goal,
            }
            if progress is not None:
                progress(seen[(p, d)])
        return bool(seen[(p, d)]["meets_goal"])

    best: dict[str, Any] | None = None
    for p in p_range:
        if best is not None and cost(p, d_range[0]) >= best["cost_per_hour"]:
            break
        if not evaluate(p, d_range[-1]):
            continue
        lo, hi = 0, len(d_range) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if evaluate(p, d_range[mid]):
                hi = mid
            else:
                lo = mid + 1
        found = seen[(p, d_range[lo])]
        if best is None or found["cost_per_hour"] < best["cost_per_hour"]:
            best = found
    return {
        "goal": goal,
        "priced": priced,
        "prefill_hardware": pre_hw.name,
        "decode_hardware": dec_hw.name,
        "evaluated": sorted(seen.values(), key=lambda r: (r["prefill"], r["decode"])),
        "cheapest": best,
    }
