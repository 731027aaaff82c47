"""/health latency while the server takes maximal request bodies (issue: "/health answering
within 100 ms during a maximal request").

A separate process polls /health every 10 ms while this one posts an 8 MB text prompt, a 5.4 MB
and a 7.9 MB (~2M ids, the most an 8 MB body holds) token-id prompt to /v1/completions, three
times each. Against a running server (`hetserve serve --port 8311`):

    flock /tmp/hetserve-heavy.lock .venv/bin/python scripts/health_latency.py --url http://127.0.0.1:8311
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import httpx


def poll(url: str, q, stop) -> None:
    client, res = httpx.Client(), []
    while not stop.is_set():
        t = time.perf_counter()
        client.get(url + "/health")
        res.append(time.perf_counter() - t)
        time.sleep(0.01)
    q.put(res)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8311")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    url = args.url
    bodies = {
        "text": json.dumps({"prompt": "hello world " * 690000, "max_tokens": 1}),
        "token ids": json.dumps({"prompt": list(range(10, 500)) * 2300, "max_tokens": 1}),
        "token ids, compact": json.dumps(
            {"prompt": list(range(10, 500)) * 4200, "max_tokens": 1}, separators=(",", ":")
        ),
    }
    for name, body in bodies.items():
        for _ in range(args.repeats):
            q, stop = mp.Queue(), mp.Event()
            poller = mp.Process(target=poll, args=(url, q, stop))
            poller.start()
            time.sleep(0.5)
            t = time.perf_counter()
            r = httpx.post(
                url + "/v1/completions",
                content=body,
                timeout=60,
                headers={"content-type": "application/json"},
            )
            dt = time.perf_counter() - t
            time.sleep(0.2)
            stop.set()
            res = q.get()
            poller.join()
            print(
                f"{name} ({len(body) / 1e6:.1f} MB): HTTP {r.status_code} in {dt * 1e3:.0f} ms; "
                f"/health worst {max(res) * 1e3:.0f} ms, median "
                f"{statistics.median(res) * 1e3:.1f} ms over {len(res)} polls"
            )


if __name__ == "__main__":
    main()
