"""Routing and admission for a prefill/decode cluster: cluster state in, decision out.

Who calls it: the live Conductor (`conductor.py`) for every request, and the simulator
(`hetserve.sim`), which imports this module as it is, so a simulated cluster decides exactly as a
live one would. Pure: no I/O, no clock (`now` is an argument), no randomness but the policy's
own seeded generator. The callers build a `ClusterView` (each instance's role, profile and load;
for this request, how much of its prefix each instance holds in each tier) and call
`Router.decide(view, request, now)`.

Policies (`--policy`):
- `random`, `round-robin`: baselines.
- `load`: the prefill instance with the shortest predicted queue.
- `cache-aware`: the longest prefix held (any tier), unless the cluster is imbalanced, then the
  least loaded (SGLang's gateway: imbalanced when the busiest instance has more than
  `balance_abs` queued requests over the idlest and more than `balance_rel` times as many).
- `tier-credit`: Dynamo's KV router cost, in blocks: queued prefill blocks + prompt blocks -
  overlap credited per tier (device 1.0, host 0.75, disk 0.25 by default) + decode blocks.
- `kvcentric`: Mooncake's Algorithm 1. For each prefill instance: TTFT = its queue + loading its
  own prefix from its tiers + prefilling the rest; or, where the shared pool (the store that
  spans the instances' DRAM, as Mooncake Store does) has a longer prefix, pulling it and
  prefilling less, taken only when that beats recomputing those tokens there by more than
  `balance_threshold`. The instance with the
  lowest TTFT wins; a prefix it pulls stays there, so hot prefixes replicate where load is.
  The decode instance is the one with the lowest predicted time between tokens.

Admission (`--admission`): `none`; `threshold` (reject when every prefill instance is past a
queue threshold, as the open routers do); `predictive` (Mooncake's early rejection: 429 with
Retry-After when the predicted TTFT exceeds its SLO, or when the chosen decode instance's step
time, predicted for the moment this request would reach it, exceeds the TBT SLO; that moment's
load is the caller's forecast, `InstanceState.decode_changes`, or the load now without one). Under
pressure lower priorities go first: a request of priority p (lower runs first) is admitted only
while its predictions stay within SLO * `priority_scale ** p`.

Failure contract: a view without a healthy instance of a needed role is a `Decision` with a
rejection (503-like reason), never an exception; a policy name that does not exist is a
ValueError at construction.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hetserve.config import Role
from hetserve.disagg.costs import InstanceProfile

TIER_ORDER = ("device", "dram", "ssd", "pool")  # fastest first: how a prefix is covered
LOCAL_TIERS = TIER_ORDER[:3]  # an instance's own
POOL = "pool"  # the cluster's shared store: a holder of its own, reachable by every instance


@dataclass(frozen=True)
class InstanceState:
    """One instance as the Conductor last heard of it."""

    name: str
    role: Role
    profile: InstanceProfile
    queued_prefill_tokens: int = 0  # new tokens (after cache hits) waiting to be prefilled
    queued_requests: int = 0
    running_decodes: int = 0
    decode_context_tokens: int = 0  # tokens held by the running decodes, in all
    free_blocks: int = 0
    total_blocks: int = 0
    healthy: bool = True
    # What the caller forecasts for the decode side, on the clock of `decide`'s `now`:
    # (time, change in running decodes, change in their context tokens) for each request
    # predicted to finish (negative) or to arrive from prefill (positive). The decode choice
    # and the TBT admission read the load at the moment this request would arrive; empty:
    # the load now.
    decode_changes: tuple[tuple[float, int, int], ...] = ()


@dataclass(frozen=True)
class PrefixHolding:
    """How much of this request's prefix a holder has, per tier, cumulatively: `blocks[t]` is
    the longest prefix covered by tier t and the faster ones (TIER_ORDER)."""

    holder: str  # an instance name, or POOL
    blocks: Mapping[str, int]

    def covered(self, tier: str) -> int:
        best = 0
        for t in TIER_ORDER:
            best = max(best, self.blocks.get(t, 0))
            if t == tier:
                break
        return best

    @property
    def longest(self) -> int:
        return max(self.blocks.values(), default=0)


@dataclass(frozen=True)
class ClusterView:
    instances: Sequence[InstanceState]
    holdings: Mapping[str, PrefixHolding]  # holder -> what it has of this request's prefix
    block_size: int

    def holding(self, holder: str) -> PrefixHolding:
        return self.holdings.get(holder) or PrefixHolding(holder, {})


@dataclass(frozen=True)
class RequestInfo:
    request_id: str
    num_tokens: int  # prompt tokens
    priority: int = 0  # lower runs first
    expected_output_tokens: int = 0  # a hint for the decode side (0: unknown)


@dataclass(frozen=True)
class Pull:
    """Blocks the prefill instance loads before prefilling: from its own tier or another
    holder (then it keeps them: replication)."""

    source: str  # holder name (the instance itself for its own tiers), or POOL
    tier: str
    blocks: int


@dataclass(frozen=True)
class Decision:
    prefill: str | None
    decode: str | None
    pull: Pull | None = None
    cached_tokens: int = 0  # tokens the prefill instance will not compute
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    reject_reason: str | None = None  # set: the request is refused
    unavailable: bool = False  # refused because no instance of a needed role is healthy
    retry_after_s: float | None = None
    scores: Mapping[str, float] = field(default_factory=dict)  # per instance, for logs/tests

    @property
    def rejected(self) -> bool:
        return self.reject_reason is not None


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "kvcentric"
    admission: str = "none"
    slo_ttft_s: float | None = None
    slo_tbt_s: float | None = None
    balance_threshold: float = 0.1  # kvcentric: a pull must save this fraction of recompute
    balance_abs: int = 32  # cache-aware: SGLang gateway's defaults
    balance_rel: float = 1.0001
    cache_threshold: float = 0.5  # cache-aware: below this hit ratio, go to the emptiest
    tier_credits: Mapping[str, float] = field(
        default_factory=lambda: {"device": 1.0, "dram": 0.75, "ssd": 0.25, POOL: 0.25}
    )
    threshold_queue_tokens: int = 65536  # admission=threshold: per prefill instance
    priority_scale: float = 0.8
    seed: int = 0


POLICIES = ("random", "round-robin", "load", "cache-aware", "tier-credit", "kvcentric")
ADMISSIONS = ("none", "threshold", "predictive")


@dataclass(frozen=True)
class _Option:
    """One way to prefill on one instance: its predicted TTFT and what it pulls."""

    instance: InstanceState
    ttft_s: float
    cached_tokens: int
    pull: Pull | None


class Router:
    def __init__(self, config: RouterConfig) -> None:
        if config.policy not in POLICIES:
            raise ValueError(f"policy {config.policy!r}: choose one of {', '.join(POLICIES)}")
        if config.admission not in ADMISSIONS:
            raise ValueError(
                f"admission {config.admission!r}: choose one of {', '.join(ADMISSIONS)}"
            )
        self.config = config
        self._rng = random.Random(config.seed)
        self._next = 0  # round-robin position

    # ---- the decision ----------------------------------------------------------------------
    def decide(self, view: ClusterView, req: RequestInfo, now: float) -> Decision:
        """Where `req` runs (or why not). `now` is the clock of the instances'
        `decode_changes` (a caller without forecasts may pass any time)."""
        prefills = [i for i in view.instances if i.healthy and i.role.prefills]
        decodes = [i for i in view.instances if i.healthy and i.role.decodes]
        if not prefills or not decodes:
            role = "prefill or decode" if not (prefills or decodes) else (
                "prefill" if not prefills else "decode")  # fmt: skip
            return Decision(
                None, None, reject_reason=f"no healthy {role} instance", unavailable=True
            )
        # Every instance's TTFT is kvcentric's choice; the others need only the chosen one's.
        options: dict[str, _Option] = {}
        if self.config.policy == "kvcentric":
            pooled = view.holding(POOL).longest
            options = {p.name: self._option(view, req, p, pooled) for p in prefills}
        name = self._pick_prefill(view, req, prefills, options)
        if name not in options:
            options[name] = self._option(view, req, next(p for p in prefills if p.name == name))
        chosen = options[name]
        decode, tbt = self._pick_decode(req, chosen, decodes, now + chosen.ttft_s)
        decision = Decision(
            chosen.instance.name,
            decode.name,
            pull=chosen.pull,
            cached_tokens=chosen.cached_tokens,
            predicted_ttft_s=chosen.ttft_s,
            predicted_tbt_s=tbt,
            scores={n: o.ttft_s for n, o in options.items()},
        )
        return self._admit(decision, req, prefills)

    # ---- prefill side ------------------------------------------------------------------------
    def _option(
        self, view: ClusterView, req: RequestInfo, inst: InstanceState, pooled: int | None = None
    ) -> _Option:
        """The best way to prefill `req` on `inst` (kvcentric's inner loop; every policy's
        TTFT prediction). `pooled`: the pool's longest prefix of the request, if the caller
        has it (the same for every instance)."""
        prof, bs, n = inst.profile, view.block_size, req.num_tokens
        fit = prof.prefill
        usable = (n - 1) // bs  # the last token is always computed (its logits are needed)
        # What the client waits beside the compute (HTTP, hand-off, the first token's way
        # back): the same wherever the prefix comes from, so it shifts every option alike.
        queue = fit.queue_seconds(inst.queued_prefill_tokens, inst.queued_requests)
        queue += prof.delivery_seconds(n)
        best_ttft, best_k, best_tier = queue + fit.seconds(n, 0), 0, ""
        own = view.holdings.get(inst.name)
        held = own.blocks if own is not None else {}
        load, covered, reach = 0.0, 0, 0
        for tier in LOCAL_TIERS if held else ():  # its own tiers, fastest first: load what
            reach = max(reach, held.get(tier, 0))  # it has, prefill the rest
            k = min(reach, usable)
            if k <= covered:
                continue
            seg = prof.load_seconds(tier, (k - covered) * bs)
            if seg is None:
                break  # a tier it cannot read: nothing past it counts
            load, covered = load + seg, k
            ttft = queue + load + fit.seconds(n - k * bs, k * bs)
            if ttft < best_ttft:
                best_ttft, best_k, best_tier = ttft, k, tier
        local = best_k
        k = min(view.holding(POOL).longest if pooled is None else pooled, usable)
        move = prof.load_seconds(POOL, (k - local) * bs) if k > local else None
        if move is not None:  # a longer prefix in the shared pool: pull it?
            rest = fit.seconds(n - k * bs, k * bs)
            recompute = fit.seconds(n - local * bs, local * bs) - rest
            # Taken only where it beats recomputing those tokens by the balancing margin.
            if move <= (1 - self.config.balance_threshold) * recompute:
                ttft = queue + move + rest
                if ttft < best_ttft:
                    return _Option(inst, ttft, k * bs, Pull(POOL, POOL, k))
        pull = Pull(inst.name, best_tier, best_k) if best_tier not in ("", "device") else None
        return _Option(inst, best_ttft, best_k * bs, pull)

    def _pick_prefill(
        self,
        view: ClusterView,
        req: RequestInfo,
        prefills: list[InstanceState],
        options: Mapping[str, _Option],
    ) -> str:
        policy = self.config.policy
        if policy == "random":
            return self._rng.choice(prefills).name
        if policy == "round-robin":
            inst = prefills[self._next % len(prefills)]
            self._next += 1
            return inst.name
        if policy == "load":
            return min(prefills, key=lambda i: (_queue_s(i), i.name)).name
        if policy == "cache-aware":
            return self._cache_aware(view, req, prefills)
        if policy == "tier-credit":
            return min(prefills, key=lambda i: (self._tier_cost(view, req, i), i.name)).name
        return min(options.values(), key=lambda o: (o.ttft_s, o.instance.name)).instance.name

    def _cache_aware(
        self, view: ClusterView, req: RequestInfo, prefills: list[InstanceState]
    ) -> str:
        cfg = self.config
        loads = [i.queued_requests + i.running_decodes for i in prefills]
        hi, lo = max(loads), min(loads)
        if hi - lo > cfg.balance_abs and hi > cfg.balance_rel * lo:
            return min(prefills, key=lambda i: (i.queued_requests + i.running_decodes, i.name)).name
        blocks = max(1, (req.num_tokens - 1) // view.block_size)
        best = max(prefills, key=lambda i: (view.holding(i.name).longest, -_queue_s(i), i.name))
        if view.holding(best.name).longest / blocks >= cfg.cache_threshold:
            return best.name
        # A poor match anywhere: the instance with the most free KV (SGLang: smallest tree).
        return max(prefills, key=lambda i: (i.free_blocks, i.name)).name

    def _tier_cost(self, view: ClusterView, req: RequestInfo, inst: InstanceState) -> float:
        bs = view.block_size
        own = view.holding(inst.name)
        credit, covered = 0.0, 0
        for tier in TIER_ORDER:
            k = own.covered(tier)
            if k > covered:
                credit += (k - covered) * self.config.tier_credits.get(tier, 0.0)
                covered = k
        queued = math.ceil(inst.queued_prefill_tokens / bs)
        prompt = math.ceil(req.num_tokens / bs)
        decode = math.ceil(inst.decode_context_tokens / bs)
        return queued + prompt - credit + decode

    # ---- decode side -------------------------------------------------------------------------
    def _pick_decode(
        self,
        req: RequestInfo,
        chosen: _Option,
        decodes: list[InstanceState],
        at: float,
    ) -> tuple[InstanceState, float]:
        """The decode instance with the lowest step time once `req` joins it at `at`."""
        if chosen.instance.role is Role.BOTH and chosen.instance in decodes:
            return chosen.instance, _tbt(chosen.instance, req, at)
        best = min(decodes, key=lambda d: (_tbt(d, req, at), d.name))
        return best, _tbt(best, req, at)

    # ---- admission ---------------------------------------------------------------------------
    def _admit(
        self, decision: Decision, req: RequestInfo, prefills: list[InstanceState]
    ) -> Decision:
        cfg = self.config
        if cfg.admission == "none":
            return decision
        scale = cfg.priority_scale ** max(req.priority, 0)
        if cfg.admission == "threshold":
            limit = cfg.threshold_queue_tokens * scale
            if all(p.queued_prefill_tokens >= limit for p in prefills):
                return _reject(decision, "every prefill instance is past its queue threshold", 1.0)
            return decision
        ttft, tbt = decision.predicted_ttft_s or 0.0, decision.predicted_tbt_s or 0.0
        if cfg.slo_ttft_s is not None and ttft > cfg.slo_ttft_s * scale:
            wait = ttft - cfg.slo_ttft_s * scale
            return _reject(decision, f"predicted TTFT {ttft:.3g} s exceeds the SLO", wait)
        if cfg.slo_tbt_s is not None and tbt > cfg.slo_tbt_s * scale:
            return _reject(decision, f"predicted TBT {tbt * 1e3:.3g} ms exceeds the SLO", 1.0)
        return decision


def _queue_s(inst: InstanceState) -> float:
    return inst.profile.prefill.queue_seconds(inst.queued_prefill_tokens, inst.queued_requests)


def _tbt(inst: InstanceState, req: RequestInfo, at: float) -> float:
    """A decode step of `inst` once this request joins its batch at `at` (the forecast
    changes up to then applied)."""
    batch, context = inst.running_decodes, inst.decode_context_tokens
    for when, d_batch, d_context in inst.decode_changes:
        if when <= at:
            batch, context = batch + d_batch, context + d_context
    context = max(context, 0) + req.num_tokens + req.expected_output_tokens // 2
    return inst.profile.decode.seconds(max(batch, 0) + 1, context)


def _reject(decision: Decision, reason: str, retry_after_s: float) -> Decision:
    return Decision(
        decision.prefill,
        decision.decode,
        predicted_ttft_s=decision.predicted_ttft_s,
        predicted_tbt_s=decision.predicted_tbt_s,
        reject_reason=reason,
        retry_after_s=max(1.0, math.ceil(retry_after_s)),
        scores=decision.scores,
    )
