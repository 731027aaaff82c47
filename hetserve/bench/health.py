"""`hetserve bench health`: /health latency while a running server takes maximal request bodies
(the goal: /health answers within 100 ms during a maximal request).

A separate process polls /health every --poll-interval-ms, first for --idle-s with nothing else
sent (the peer of every row: the same server and client, unloaded, in the same run), then while
this one posts each body to /v1/completions --repeats times: an 8 MB text prompt, and as many
token ids as fit, with JSON's default ", " and with compact separators (the most ids a body
holds); each just under the server's --max-request-mb. A poll counts for a post when the two
overlap in time. Bodies this large are parsed on a worker thread; what a poll can still wait
for is the GIL.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

from hetserve.bench.common import add_server_args

GOAL_MS = 100.0
FILL = 0.98  # of the server's limit: room for the JSON around the prompt


def register(sub) -> None:
    p = sub.add_parser("health", help="/health latency while the server takes maximal bodies")
    add_server_args(p)
    p.add_argument(
        "--max-request-mb",
        type=float,
        default=8.0,
        help="the server's --max-request-mb (MiB): bodies are sized just under it",
    )
    p.add_argument("--repeats", type=int, default=3, help="posts of each body")
    p.add_argument("--poll-interval-ms", type=float, default=10.0)
    p.add_argument("--idle-s", type=float, default=2.0, help="seconds polled with no load first")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--json", "--result-file", dest="json", default=None, help="write JSON here")
    p.set_defaults(func=run)


def _poll(url: str, interval_s: float, ready, stop, out) -> None:
    """The poller process: puts [(start time, seconds)] of every /health call until `stop`,
    or the error that ended it (a string)."""
    import httpx

    res: list[tuple[float, float]] = []
    try:
        with httpx.Client(timeout=30) as client:
            client.get(url + "/health")  # connected before anyone waits on it
            ready.set()
            while not stop.is_set():
                t = time.monotonic()  # CLOCK_MONOTONIC: comparable with the parent's clock
                client.get(url + "/health")
                res.append((t, time.monotonic() - t))
                time.sleep(interval_s)
    except Exception as exc:  # whatever ended it, the parent says it (no traceback)
        out.put(f"{url}/health: {exc}")
        return
    out.put(res)


def bodies(limit_bytes: int) -> dict[str, str]:
    """name -> the largest body of that kind under FILL x limit_bytes."""
    from hetserve.errors import InvalidInputError

    budget = int(limit_bytes * FILL)
    ids = list(range(10, 500))

    def fill(unit: list | str, dump) -> str:
        # One unit's bytes, from the difference of two sizes (the JSON around it cancels).
        one, two = len(dump(unit)), len(dump(unit * 2))
        n = (budget - (2 * one - two)) // (two - one)
        if n < 1:
            raise InvalidInputError(f"--max-request-mb {limit_bytes / (1 << 20):g} is too small")
        return dump(unit * n)

    def body(sep: tuple[str, str] | None):
        return lambda prompt: json.dumps({"prompt": prompt, "max_tokens": 1}, separators=sep)

    return {
        "text": fill("hello world ", body(None)),
        "token ids": fill(ids, body(None)),
        "token ids, compact": fill(ids, body((",", ":"))),
    }


def _stats(polls: list[float]) -> dict:
    if not polls:
        return {"polls": 0, "median_ms": None, "worst_ms": None}
    return {
        "polls": len(polls),
        "median_ms": statistics.median(polls) * 1e3,
        "worst_ms": max(polls) * 1e3,
    }


def _overlapping(polls: list[tuple[float, float]], t0: float, t1: float) -> list[float]:
    return [dt for t, dt in polls if t <= t1 and t + dt >= t0]


def _check(args: argparse.Namespace) -> None:
    from hetserve.errors import InvalidInputError

    for flag in ("max_request_mb", "repeats", "poll_interval_ms", "idle_s", "request_timeout"):
        if getattr(args, flag) <= 0:
            raise InvalidInputError(f"--{flag.replace('_', '-')} must be positive")


def _post_all(args: argparse.Namespace, payloads: dict[str, str]) -> dict[str, list]:
    """name -> [(start, end, HTTP status), ...] of its posts."""
    import httpx

    from hetserve import envs

    headers = {"content-type": "application/json"}
    api_key = args.api_key or envs.openai_api_key()
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    posts: dict[str, list] = {name: [] for name in payloads}
    with httpx.Client(timeout=args.request_timeout, headers=headers) as client:
        for name, body in payloads.items():
            for _ in range(args.repeats):
                time.sleep(0.2)  # a few quiet polls between posts
                t0 = time.monotonic()
                r = client.post(args.url + "/v1/completions", content=body)
                posts[name].append((t0, time.monotonic(), r.status_code))
    return posts


def run(args: argparse.Namespace) -> int:
    import httpx

    from hetserve.errors import InvalidInputError

    _check(args)
    args.url = args.url.rstrip("/")
    payloads = bodies(int(args.max_request_mb * (1 << 20)))
    ctx = mp.get_context("spawn")  # a fresh interpreter: nothing of this one's state or GIL
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    poller = ctx.Process(
        target=_poll, args=(args.url, args.poll_interval_ms / 1e3, ready, stop, out), daemon=True
    )
    poller.start()
    try:
        while not ready.wait(0.1) and poller.is_alive():
            pass
        if ready.is_set():
            idle = (time.monotonic(), time.monotonic() + args.idle_s)
            time.sleep(args.idle_s)
            posts = _post_all(args, payloads)
            time.sleep(0.2)
    except httpx.HTTPError as exc:
        raise InvalidInputError(f"{args.url}/v1/completions: {exc}") from None
    finally:
        stop.set()
        polls = out.get(timeout=60)
        poller.join(10)
    if isinstance(polls, str):  # the poller's error
        raise InvalidInputError(polls)
    _report(args, payloads, polls, idle, posts)
    return 0


def _row(name: str, size: int, done: list, polls: list, idle_worst_ms: float | None) -> dict:
    seen = [_overlapping(polls, t0, t1) for t0, t1, _ in done]
    s = _stats([dt for per in seen for dt in per])
    worst = s["worst_ms"]
    return {
        "body": name,
        "bytes": size,
        "statuses": [c for *_, c in done],
        "post_ms": [(t1 - t0) * 1e3 for t0, t1, _ in done],
        **s,
        "worst_per_post_ms": [max(per) * 1e3 if per else None for per in seen],
        "worst_vs_idle": worst / idle_worst_ms if worst and idle_worst_ms else None,
        "within_goal": None if worst is None else worst <= GOAL_MS,  # None: no poll landed
    }


def _report(
    args: argparse.Namespace,
    payloads: dict[str, str],
    polls: list,
    idle: tuple[float, float],
    posts: dict[str, list],
) -> None:
    from hetserve.bench.common import print_table, write_json

    base = _stats(_overlapping(polls, *idle))
    rows = [_row(n, len(payloads[n]), done, polls, base["worst_ms"]) for n, done in posts.items()]
    table = [["none (idle)", 0.0, None, None, base["polls"], base["median_ms"], base["worst_ms"],
              1.0]]  # fmt: skip
    table += [[r["body"], r["bytes"] / 1e6, ",".join(map(str, sorted(set(r["statuses"])))),
               statistics.median(r["post_ms"]), r["polls"], r["median_ms"], r["worst_ms"],
               r["worst_vs_idle"]] for r in rows]  # fmt: skip
    print_table(["body", "MB", "HTTP", "post ms", "polls", "health median ms",
                 "health worst ms", "worst vs idle"], table)  # fmt: skip
    verdicts = [r["within_goal"] for r in rows if r["within_goal"] is not None]
    met = "met" if verdicts and all(verdicts) else "NOT met" if verdicts else "not measured"
    print(f"goal: /health within {GOAL_MS:.0f} ms during every post: {met}")
    write_json(
        args.json,
        {
            "benchmark": "health",
            "url": args.url,
            "max_request_mb": args.max_request_mb,
            "repeats": args.repeats,
            "poll_interval_ms": args.poll_interval_ms,
            "goal_ms": GOAL_MS,
            "idle": base,
            "bodies": rows,
        },
    )
