"""`hetserve bench prefix`: time to first token with a cold prefix cache, and warm from each
place a prefix can be: the device pool, and the KV tiers behind it (host DRAM, SSD, the pool
service), all in one run.

Each prompt shares --shared-frac of its tokens with the next. Cold: a prefix never seen (fresh
per trial). Warm: the same prefix again with a new suffix. For a tier, the cold request's blocks
are saved to the store and the device prefix cache is dropped before the warm request, which
then finds the prefix in that tier only (SSD rows read with the page cache dropped). TTFT is the
time of a max_tokens=1 request: any load, the uncached prefill and one sampling step. The
load-or-recompute rule must keep every warm/cold ratio at or below 1.0. A second table puts each
tier's loads as the cost model predicted them next to what they took (the read, and what the
request waited for it), per load.

--tiers sets up the stores itself: `dram` a local DRAM store, `ssd` a local store whose DRAM
holds nothing (every block on the SSD at --ssd-dir), `pool` a pool service (master and one node)
started on 127.0.0.1; --kv-store adds a row for a store of your own.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace

from tqdm import tqdm

from hetserve.bench.common import print_table, require_at_least, write_json
from hetserve.config import EngineConfig, add_engine_args
from hetserve.errors import InvalidInputError
from hetserve.model.synthetic import make_prompts

TIERS = ("device", "dram", "ssd", "pool")


def register(sub) -> None:
    p = sub.add_parser("prefix", help="TTFT cold vs warm from the device pool and each KV tier")
    add_engine_args(p)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--shared-frac", type=float, default=0.9)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument(
        "--tiers",
        default="device",
        help=f"comma-separated rows among {','.join(TIERS)} (stores set up by the bench)",
    )
    p.add_argument("--ssd-dir", default=None, help="where the ssd row's store keeps its files")
    p.add_argument("--store-gb", type=float, default=4.0, help="size of each bench store")
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 0 < args.shared_frac < 1:
        raise InvalidInputError("--shared-frac must be between 0 and 1")
    require_at_least(args, 1, "prompt_len", "trials")
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    bad = [t for t in tiers if t not in TIERS]
    if bad or not tiers:
        raise InvalidInputError(f"unknown --tiers {bad or args.tiers!r}; choose from {TIERS}")
    base = EngineConfig.from_args(args)
    rows = [(t, None) for t in tiers]
    if base.cache.kv_store:
        rows.append((base.cache.kv_store, base.cache.kv_store))
    results = []
    with tempfile.TemporaryDirectory() as tmp, _stores(args, tiers, tmp) as specs:
        for name, spec in rows:
            spec = spec or specs.get(name)
            cfg = replace(base, cache=replace(base.cache, kv_store=spec))
            results.append(_measure(cfg, name, args))
    _report(args, results)
    return 0


@contextlib.contextmanager
def _stores(args, tiers: list[str], tmp: str) -> Iterator[dict[str, str]]:
    size = f"{int(args.store_gb * 1024)}M"
    specs = {"dram": f"local://?dram={size}"}
    specs["ssd"] = f"local://?dram=4K&ssd_dir={args.ssd_dir or tmp}&ssd={size}"
    procs = []
    try:
        if "pool" in tiers:
            specs["pool"], procs = _start_pool(size)
        yield specs
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_pool(size: str) -> tuple[str, list[subprocess.Popen]]:
    port, node_port = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "hetserve.entrypoints.store"]
    master = subprocess.Popen([*cmd, "master", "--port", str(port), "--max-value", "1G"])
    node = subprocess.Popen(
        [*cmd, "node", "--master", f"127.0.0.1:{port}", "--dram", size, "--port", str(node_port)]
    )
    spec = f"pool://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    from hetserve.store import open_store

    while True:
        try:
            with open_store(spec) as client:
                if client.stats()["nodes"]:
                    return spec, [node, master]
        except Exception:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def _measure(cfg: EngineConfig, name: str, args) -> dict:
    from hetserve import LLM, SamplingParams

    llm = LLM(cfg)
    try:
        if args.prompt_len >= llm.max_model_len:
            raise InvalidInputError(f"--prompt-len must be below the context ({llm.max_model_len})")
        shared = int(args.prompt_len * args.shared_frac)
        pool = make_prompts(str(llm.model_dir), 3 * args.trials + 1, args.prompt_len, seed=1)
        params = SamplingParams(max_tokens=1)

        def ttft(ids):
            t0 = time.perf_counter()
            out = llm.generate(prompt_token_ids=ids, sampling_params=params)[0]
            return time.perf_counter() - t0, out

        ttft(pool[-1])  # warm-up
        row = {"row": name, "kv_store": cfg.cache.kv_store, "cold_s": [], "warm_s": []}
        row |= {"warm_computed": [], "warm_cached_by_tier": []}
        for t in tqdm(range(args.trials), desc=f"bench prefix: {name}"):
            prefix = pool[3 * t][:shared]
            row["cold_s"].append(ttft(prefix + pool[3 * t + 1][shared:])[0])
            if llm.flush_kv_store(cold=True):  # only the tier holds it now
                llm.reset_prefix_cache()
            before = llm.stats().prompt_tokens_computed
            seconds, out = ttft(prefix + pool[3 * t + 2][shared:])
            row["warm_s"].append(seconds)
            row["warm_computed"].append(llm.stats().prompt_tokens_computed - before)
            row["warm_cached_by_tier"].append(out.cached_tokens_by_tier)
        row["summary"] = llm.kv_summary
        stats = llm.stats().tiers
        row["skipped_blocks"] = stats.skipped_blocks if stats else 0
        row["load_fit"] = {t: _per_load(f) for t, f in (stats.load_fit if stats else {}).items()}
        return row
    finally:
        llm.close()


def _per_load(fit) -> dict:
    """One tier's `LoadFit` as milliseconds per load, predicted and measured."""
    per = 1e3 / fit.loads
    return {
        "loads": fit.loads,
        "predicted_ms": fit.predicted_s * per,
        "measured_ms": fit.measured_s * per,
        "ratio": fit.ratio,
        "wait_predicted_ms": fit.predicted_wait_s * per,
        "wait_measured_ms": fit.measured_wait_s * per,
        "wait_ratio": fit.wait_ratio,
    }


def _report(args, results: list[dict]) -> None:
    table = []
    for r in results:
        cold, warm = statistics.median(r["cold_s"]), statistics.median(r["warm_s"])
        r["warm_over_cold"] = warm / cold
        origin = r["warm_cached_by_tier"][-1] or {"recomputed": 0}
        computed = statistics.median(r["warm_computed"])
        table.append([r["row"], cold, warm, warm / cold, ", ".join(origin), computed])
    headers = ["warm from", "cold TTFT (s)", "warm TTFT (s)", "warm/cold", "cached in", "computed"]
    print_table(headers, table)
    fits = [
        [r["row"], tier, f["loads"], f["predicted_ms"], f["measured_ms"], f["ratio"],
         f["wait_predicted_ms"], f["wait_measured_ms"], f["wait_ratio"]]
        for r in results
        for tier, f in r["load_fit"].items()
    ]  # fmt: skip
    if fits:
        print()
        print_table(
            ["row", "tier", "loads", "predicted ms", "measured ms", "ratio",
             "wait predicted ms", "wait ms", "wait ratio"],
            fits,
        )  # fmt: skip
    for r in results:
        if r["summary"]:
            print(f"{r['row']}: {r['summary']}")
    write_json(
        args.json,
        {
            "benchmark": "prefix",
            "model": args.model,
            "prompt_len": args.prompt_len,
            "shared_tokens": int(args.prompt_len * args.shared_frac),
            "trials": args.trials,
            "rows": results,
        },
    )
