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
    grid = _Grid(plan, goal, progress)
    (n_pre, _), (n_dec, _) = plan.prefill.groups[0], plan.decode.groups[0]
    d_range = ranges.get("decode", range(n_dec, n_dec + 1))
    best: dict[str, Any] | None = None
    for p in ranges.get("prefill", range(n_pre, n_pre + 1)):
        if best is not None and grid.cost(p, d_range[0]) >= best["cost_per_hour"]:
            break  # its prefill instances alone cost more than the best mix
        found = grid.fewest_decodes(p, d_range)
        if found is not None and (best is None or found["cost_per_hour"] < best["cost_per_hour"]):
            best = found
    return {
        "goal": goal,
        "priced": grid.priced,
        "prefill_hardware": grid.pre.name,
        "decode_hardware": grid.dec.name,
        "evaluated": sorted(grid.seen.values(), key=lambda r: (r["prefill"], r["decode"])),
        "cheapest": best,
    }


class _Grid:
    """Mixes evaluated once each (one simulation per mix)."""

    def __init__(
        self, plan: Plan, goal: float, progress: Callable[[dict[str, Any]], None] | None
    ) -> None:
        self.plan, self.goal, self.progress = plan, goal, progress
        self.pre, self.dec = plan.prefill.groups[0][1], plan.decode.groups[0][1]
        self.priced = self.pre.price_per_hour > 0 or self.dec.price_per_hour > 0
        global_pool = "global" in plan.caches
        self.nodes = sum(n.price_per_hour for n in plan.cache_nodes) if global_pool else 0.0
        self.seen: dict[tuple[int, int], dict[str, Any]] = {}

    def cost(self, p: int, d: int) -> float:
        if not self.priced:
            return float(p + d)
        return p * self.pre.price_per_hour + d * self.dec.price_per_hour + self.nodes

    def fewest_decodes(self, p: int, d_range: range) -> dict[str, Any] | None:
        """The mix with `p` prefill instances and the fewest decode ones meeting the goal
        (bisection; None when even the most do not)."""
        if not self.meets(p, d_range[-1]):
            return None
        lo, hi = 0, len(d_range) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.meets(p, d_range[mid]):
                hi = mid
            else:
                lo = mid + 1
        return self.seen[(p, d_range[lo])]

    def meets(self, p: int, d: int) -> bool:
        if (p, d) not in self.seen:
            plan = self.plan
            cfg = config(
                plan, plan.policies[0], plan.admissions[0], plan.caches[0],
                prefill=plan.prefill.with_count(p), decode=plan.decode.with_count(d),
            )  # fmt: skip
            s = summarize(simulate(plan, cfg))
            self.seen[(p, d)] = {
                "prefill": p,
                "decode": d,
                "cost_per_hour": self.cost(p, d),
                "effective_ratio": s["effective_ratio"],
                "goodput_per_dollar": s["goodput_per_dollar"],
                "ttft_mean_s": s["ttft_s"]["mean"],
                "tbt_p90_s": s["tbt_s"]["p90"],
                "meets_goal": s["effective_ratio"] >= self.goal,
            }
            if self.progress is not None:
                self.progress(self.seen[(p, d)])
        return bool(self.seen[(p, d)]["meets_goal"])
