"""The engine's cost model at start-up: a few timed forwards of throwaway sequences, so that the
first prompt chunk sized by time and the first load-or-recompute decision have a model to ask.
Every real step refines it afterwards (`EngineCore.step`).

Who calls it: `EngineCore.__init__`, once, before any request. The probe's blocks come from the
free pool and go back to it uncached; routing statistics being recorded do not see the probe.

The probes' times are kept under the cache directory (`probe_cache_file`), keyed by what they
depend on: the model directory's files (names, sizes, times), the placement, the KV cache's
dtype, the device, the thread count, the CPU, hetserve's own sources and the HETSERVE_ / OpenMP
environment. A start that finds the same probes there uses those times instead of running them
(about 2 s of the 1.7 B MoE's 3 s start); a file that cannot be read or written, or whose
probes differ, is ignored. HETSERVE_STEP_PROBE_CACHE=0 turns it off.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch

from hetserve import envs
from hetserve.engine.runner import ModelRunner, SeqInput
from hetserve.kv.manager import KVCacheManager
from hetserve.kv.step_time import StepShape, StepTimeModel
from hetserve.kv.tier_policy import CostModel
from hetserve.model.base import CausalLM

PROBE_TOKENS = 64  # a prompt chunk's length in the probe (less where the pool is smaller)
SMALL_CHUNK = 8  # a few prompt tokens: the fixed cost and the experts they touch
# Chunks after this many cached tokens (less where the pool or the context is shorter): chunks
# of one size deep in a prompt cannot tell a cost per cached row a chunk gathers from one per
# attention pair (both grow with the context), and the efficiency rule of the step budget
# weighs them differently; a small and a longer chunk after a long context tell them apart.
LONG_CONTEXT = 1024
# Each probe runs twice and the faster counts: a first run pays one-off costs (allocations,
# first touches of KV pages, kernels loaded) and other jobs on the machine only ever slow a run
# down. Where the two runs differ by more than AGREE, a third decides (the first probe's runs
# mostly, on a noisy machine a few more): three runs of every probe took 2.5-2.7 s of the
# 1.7 B MoE's start-up, this 2.0-2.4 s (21 forwards of 27).
AGREE = 0.10


def step_time_model(model: CausalLM) -> StepTimeModel:
    """An empty fit for `model`: with its routed experts' count and top-k on a MoE."""
    decoder = len(model.model.layers)
    layers = model.moe_layers()
    if not layers:
        return StepTimeModel(layers=decoder)
    cfg = layers[0].gate.cfg
    return StepTimeModel(cfg.num_experts, cfg.top_k, decoder)


@torch.inference_mode()
def measure_steps(
    runner: ModelRunner,
    kv: KVCacheManager,
    cost: CostModel,
    max_len: int | None = None,
    cache: Path | None = None,
) -> None:
    """Time a prompt chunk, the same chunk after as many cached tokens (attention over a
    longer context), a small chunk, decodes after long and short contexts, alone and
    together, a decode with a small chunk, and a small and the first chunk after a long
    context (within `max_len` tokens): the step-time fit's first steps (each term has one
    that moves it alone); the first chunk's rate is the tiers' prefill rate. `cache`: where
    these probes' times were kept by an earlier start (used when its probes are these) and are
    kept now."""
    if runner.state is not None:
        return  # linear-attention layers need a state slot per sequence: real steps fit it
    bs = kv.block_size
    n = min(PROBE_TOKENS, (kv.pool.num_free * bs - 1) // 2)
    if n < 2:
        return  # a pool too small to probe: chunks are sized by tokens until a step is seen
    # The long context: what the pool holds beside the chunk, within the model's length.
    room = kv.pool.num_free * bs - n - 1
    if max_len is not None:
        room = min(room, max_len - n)
    far = min(LONG_CONTEXT, room) // bs * bs
    blocks = kv.pool.allocate(-(-max(2 * n + 1, far + n) // bs))
    ids = [b.block_id for b in blocks]
    vocab = runner.model.config.vocab_size
    tokens = [1 + i % (vocab - 1) for i in range(2 * n + 1)]
    small = min(SMALL_CHUNK, n)
    long_decode = SeqInput(tokens[2 * n :], 2 * n, ids)
    short_decode = SeqInput(tokens[small : small + 1], small, ids)
    # The same blocks serve every probe: what they compute is thrown away, only time counts.
    probes = [
        ([SeqInput(tokens[:n], 0, ids)], StepShape().plus(n, 0)),
        ([SeqInput(tokens[n : 2 * n], n, ids)], StepShape().plus(n, n)),
        ([long_decode], StepShape().plus(1, 2 * n)),
        ([SeqInput(tokens[:small], 0, ids)], StepShape().plus(small, 0)),
        ([short_decode], StepShape().plus(1, small)),
        ([long_decode, short_decode], StepShape().plus(1, 2 * n).plus(1, small)),
        (
            [long_decode, SeqInput(tokens[:small], 0, ids)],
            StepShape().plus(1, 2 * n).plus(small, 0),
        ),
    ]
    if far > 2 * n:  # the same cached rows serve: only the shape of the work counts
        probes += [
            ([SeqInput(tokens[:small], far, ids)], StepShape().plus(small, far)),
            ([SeqInput(tokens[:n], far, ids)], StepShape().plus(n, far)),
        ]
    shapes = [shape for _, shape in probes]
    best = _cached(cache, shapes)
    stats = runner.model.routing_stats
    if stats is not None:
        runner.model.attach_routing_stats(None)
    try:
        if best is None:
            best = [_fastest(runner, seqs) for seqs, _ in probes]
            _keep(cache, shapes, best)
    finally:
        kv.pool.free(blocks)
        if stats is not None:
            runner.model.attach_routing_stats(stats)
    for (_, shape), seconds in zip(probes, best, strict=True):
        cost.steps.observe(shape, seconds, probe=True)
    cost.prefill_tokens_per_s = n / best[0]


def _fastest(runner: ModelRunner, seqs: list[SeqInput]) -> float:
    """The fastest of two runs of `seqs`, or of three where the two disagree."""
    a, b = _forward(runner, seqs), _forward(runner, seqs)
    if abs(a - b) <= AGREE * min(a, b):
        return min(a, b)
    return min(a, b, _forward(runner, seqs))


def _forward(runner: ModelRunner, seqs: list[SeqInput]) -> float:
    t0 = time.perf_counter()
    runner.forward(seqs)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)  # the forward is queued, not done
    return time.perf_counter() - t0


def _shape_row(shape: StepShape) -> list[int]:
    return list(dataclasses.astuple(shape))


def _cached(path: Path | None, shapes: list[StepShape]) -> list[float] | None:
    """The kept times of exactly these probes, or None."""
    if path is None:
        return None
    try:
        kept = json.loads(path.read_text())
        rows, seconds = kept["shapes"], [float(t) for t in kept["seconds"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if rows != [_shape_row(s) for s in shapes] or not all(t > 0 for t in seconds):
        return None
    return seconds if len(seconds) == len(shapes) else None


def _keep(path: Path | None, shapes: list[StepShape], seconds: list[float]) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"shapes": [_shape_row(s) for s in shapes], "seconds": seconds}))
        os.replace(tmp, path)  # a concurrent start reads a whole file or none
    except OSError:
        pass


def probe_cache_file(model_dir: str | Path, runner: ModelRunner, placement: str) -> Path | None:
    """Where the probes of this model, placement and machine are kept (None: turned off)."""
    if not envs.step_probe_cache():
        return None
    facts = {
        "model": _files(Path(model_dir)),
        "placement": placement,
        "kv_dtype": str(runner.kv.dtype),
        "device": str(runner.device),
        "threads": torch.get_num_threads(),
        "cpu": _cpu(),
        "code": _code(),
        "torch": torch.__version__,
        "env": {
            k: v
            for k, v in os.environ.items()
            if k.startswith(("HETSERVE_", "OMP_", "GOMP_", "KMP_"))
        },  # fmt: skip
    }
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:24]
    return envs.cache_dir() / "step-probes" / f"{key}.json"


def _files(root: Path) -> list[tuple[str, int, int]]:
    """The model's files (a GGUF: the file), with sizes and times, under its resolved path."""
    try:
        paths = [root] if root.is_file() else [p for p in root.iterdir() if p.is_file()]
        rows = [(str(p.resolve()), (st := p.stat()).st_size, st.st_mtime_ns) for p in paths]
    except OSError:
        return []
    return sorted(rows)


@functools.cache
def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), ""
            )
    except OSError:
        name = ""
    return f"{name or platform.processor()} x{os.cpu_count()}"


@functools.cache
def _code() -> str:
    """A digest of hetserve's sources (names, sizes, times): edited code is timed anew."""
    root = Path(__file__).resolve().parents[1]
    rows = sorted((str(p.relative_to(root)), (st := p.stat()).st_size, st.st_mtime_ns)
                  for p in root.rglob("*") if p.suffix in (".py", ".c", ".h"))  # fmt: skip
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]
