"""`hetserve bench conductor`: what the Conductor costs a request.

Two parts, both timed here, in the same run:
- the routing decision alone, at scale: a prompt of `--prompt-tokens` (128k by default) against
  `--instances` instances (100), with its prefix spread over the instances' tiers and the pool
  as the KV index would report it: the index lookup (`disagg.index.KVIndex.holdings`, where the
  index is built; else a prepared holdings map) plus `Router.decide`, per policy; and hashing the
  prompt's blocks (the Conductor's other per-request work, reported beside it);
- end to end, with `--url` (a Conductor) and `--direct-url` (one of its instances): the same
  requests through both and through a bare TCP relay in front of the instance (`relay.py`: the
  floor one more loopback hop costs here), in turn, and the differences of their latency
  percentiles.

Goals (issue 34): a decision <= 1 ms at 100 instances and 128k tokens; <= 2 ms p99 added.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from hetserve.bench.common import machine_info, print_table, require_at_least, write_json


def register(sub) -> None:
    p = sub.add_parser("conductor", help="the Conductor's cost per request (decision, end to end)")
    p.add_argument("--instances", type=int, default=100)
    p.add_argument("--prompt-tokens", type=int, default=131072)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--policies", default="kvcentric,cache-aware,tier-credit,load")
    p.add_argument("--url", default=None, help="a Conductor, for the end-to-end part")
    p.add_argument("--direct-url", default=None, help="one of its instances, as the baseline")
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--json", "--result-file", dest="json", default=None)
    p.set_defaults(func=run)


def _cluster(n: int, block_size: int, blocks: int, seed: int = 0):
    from hetserve.config import Role
    from hetserve.disagg.costs import DecodeFit, InstanceProfile, PrefillFit
    from hetserve.disagg.policy import POOL, ClusterView, InstanceState, PrefixHolding
    from hetserve.kv.tier_policy import TierCost

    rng = random.Random(seed)
    tiers = {"dram": TierCost(2e-5, 2e10), "ssd": TierCost(1e-4, 3e9), POOL: TierCost(1e-4, 1e10)}
    prof = InstanceProfile("bench", PrefillFit(1e-3, 2e-5, 1e-10), DecodeFit(0.02, 1e-4, 1e-8),
                           100_000, tiers)  # fmt: skip
    insts, held = [], {}
    for i in range(n):
        role = (Role.PREFILL, Role.DECODE)[i % 2]
        insts.append(InstanceState(
            f"i{i:03d}", role, prof, queued_prefill_tokens=rng.randrange(0, 50_000),
            queued_requests=rng.randrange(0, 20), running_decodes=rng.randrange(0, 64),
            decode_context_tokens=rng.randrange(0, 500_000), free_blocks=rng.randrange(1, 9999),
            total_blocks=10_000))  # fmt: skip
        if rng.random() < 0.5:
            d = rng.randrange(0, blocks)
            held[f"i{i:03d}"] = PrefixHolding(f"i{i:03d}", {"device": d, "dram": d + 10})
    held[POOL] = PrefixHolding(POOL, {POOL: blocks // 2})
    return ClusterView(insts, held, block_size)


def _decision_rows(args: argparse.Namespace) -> tuple[list[list[object]], dict[str, object]]:
    from hetserve.disagg.policy import RequestInfo, Router, RouterConfig
    from hetserve.native.hash_chain import hash_prefix_digests

    blocks = args.prompt_tokens // args.block_size
    view = _cluster(args.instances, args.block_size, blocks)
    lookup = _index_lookup(args.instances, blocks)
    req = RequestInfo("bench", args.prompt_tokens)
    rows: list[list[object]] = []
    out: dict[str, object] = {}
    for policy in [p for p in args.policies.split(",") if p]:
        router = Router(RouterConfig(policy=policy, admission="predictive", slo_ttft_s=10.0))
        times, cpu = [], []
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.thread_time()
            if lookup is not None:
                lookup()
            router.decide(view, req, 0.0)
            times.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
        p50, p99, c50 = _pct(times, 50), _pct(times, 99), _pct(cpu, 50)
        rows.append([f"decide ({policy})", f"{p50 * 1e3:.3f}", f"{p99 * 1e3:.3f}",
                     f"{c50 * 1e3:.3f}", "<= 1 ms"])  # fmt: skip
        out[policy] = {"p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3, "cpu_p50_ms": c50 * 1e3}
    ids = list(range(args.prompt_tokens))
    times = []
    for _ in range(max(3, args.repeats // 20)):
        t0 = time.perf_counter()
        hash_prefix_digests(ids, args.block_size, (), b"seed")
        times.append(time.perf_counter() - t0)
    p50, p99 = _pct(times, 50), _pct(times, 99)
    rows.append(["hash prompt blocks", f"{p50 * 1e3:.3f}", f"{p99 * 1e3:.3f}", "-", "-"])
    out["hash"] = {"p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3}
    out["index_lookup_included"] = lookup is not None
    return rows, out


def _index_lookup(instances: int, blocks: int):
    """A KV index holding a random spread of the prompt's blocks, and its lookup; None where
    this build has no index (the decision is then timed without it)."""
    try:
        from hetserve.disagg.index import KVIndex
    except ImportError:
        return None
    rng = random.Random(1)
    digests = [rng.randbytes(32) for _ in range(blocks)]
    index = KVIndex()
    for i in range(instances):  # the spread _cluster reports: a device prefix, DRAM past it
        if rng.random() < 0.5:
            d = rng.randrange(0, blocks)
            index.mark(f"i{i:03d}", "GPU", digests[:d], True)
            index.mark(f"i{i:03d}", "CPU", digests[d : d + 10], True)
    index.mark("i000", "POOL", digests[: blocks // 2], True)
    return lambda: index.holdings(digests)


def _pct(xs: list[float], q: int) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, (len(xs) * q) // 100)]


def _end_to_end(args: argparse.Namespace) -> tuple[list[list[object]], dict[str, object]]:
    from urllib.parse import urlsplit

    import httpx

    from hetserve.bench.relay import Relay

    body = {"prompt": "hello " * 64, "max_tokens": 1, "temperature": 0}
    direct = urlsplit(args.direct_url)
    # The floor: one more loopback hop through a bare byte relay in its own process.
    relay = Relay(direct.hostname or "127.0.0.1", direct.port or 80)
    lat: dict[str, list[float]] = {"direct": [], "conductor": [], "relay": []}
    try:
        for i in range(args.requests):
            order = [("direct", args.direct_url), ("conductor", args.url), ("relay", relay.url)]
            for name, url in order[i % 3 :] + order[: i % 3]:  # each goes first in turn
                t0 = time.perf_counter()
                r = httpx.post(url.rstrip("/") + "/v1/completions", json=body, timeout=60)
                r.raise_for_status()
                lat[name].append(time.perf_counter() - t0)
    finally:
        relay.close()
    rows, out = [], {}
    for q in (50, 99):
        added = _pct(lat["conductor"], q) - _pct(lat["direct"], q)
        floor = _pct(lat["relay"], q) - _pct(lat["direct"], q)
        rows.append(
            [f"added latency p{q}", f"{added * 1e3:.2f} ms", "", "<= 2 ms" if q == 99 else ""]
        )
        rows.append([f"a bare TCP relay adds, p{q}", f"{floor * 1e3:.2f} ms", "", "(floor)"])
        out[f"added_p{q}_ms"] = added * 1e3
        out[f"relay_added_p{q}_ms"] = floor * 1e3
    out["median_direct_ms"] = statistics.median(lat["direct"]) * 1e3
    out["latency_s"] = lat
    # The Conductor's own work (parse, tokenize, hash, look up, decide), as it measures it:
    # the part of the added latency that is not the extra HTTP hop.
    text = httpx.get(args.url.rstrip("/") + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("hetserve_conductor_routing_seconds{"):
            q = line.split('quantile="', 1)[1].split('"', 1)[0]
            ms = float(line.rsplit(" ", 1)[1]) * 1e3
            label = f"p{round(float(q) * 100)}"
            rows.append([f"its own routing {label}", f"{ms:.2f} ms", "", ""])
            out[f"routing_{label}_ms"] = ms
    return rows, out


def run(args: argparse.Namespace) -> int:
    from hetserve.errors import InvalidInputError

    require_at_least(args, 1, "block_size", "requests")
    if args.instances < 2 or args.prompt_tokens < args.block_size or args.repeats < 1:
        raise InvalidInputError("--instances >= 2, --prompt-tokens >= --block-size, --repeats >= 1")
    if bool(args.url) != bool(args.direct_url):
        raise InvalidInputError("the end-to-end part needs both --url and --direct-url")
    from hetserve.disagg.policy import POLICIES

    for policy in [p for p in args.policies.split(",") if p]:
        if policy not in POLICIES:
            raise InvalidInputError(f"--policies: {policy!r}: choose from {', '.join(POLICIES)}")
    rows, result = _decision_rows(args)
    print(f"{args.instances} instances, a {args.prompt_tokens}-token prompt in blocks of "
          f"{args.block_size}")  # fmt: skip
    # Thread CPU time beside the wall clock: on a busy machine the wall clock also counts the
    # time this thread waited for a core.
    print_table(["what", "p50 ms", "p99 ms", "CPU p50 ms", "goal"], rows)
    payload: dict[str, object] = {"benchmark": "conductor", "machine": machine_info(),
                                  "instances": args.instances, "prompt_tokens": args.prompt_tokens,
                                  "decision": result}  # fmt: skip
    if args.url:
        e2e_rows, e2e = _end_to_end(args)
        print_table(["end to end", "value", "", "goal"], e2e_rows)
        payload["end_to_end"] = e2e
    write_json(args.json, payload)
    return 0
