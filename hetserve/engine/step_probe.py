"""The engine's cost model at start-up: a few timed forwards of throwaway sequences, so that the
first prompt chunk sized by time and the first load-or-recompute decision have a model to ask.
Every real step refines it afterwards (`EngineCore.step`).

Who calls it: `EngineCore.__init__`, once, before any request. The probe's blocks come from the
free pool and go back to it uncached; routing statistics being recorded do not see the probe.
"""

from __future__ import annotations

import time

import torch

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
    layers = model.moe_layers()
    if not layers:
        return StepTimeModel()
    cfg = layers[0].gate.cfg
    return StepTimeModel(cfg.num_experts, cfg.top_k)


@torch.inference_mode()
def measure_steps(
    runner: ModelRunner, kv: KVCacheManager, cost: CostModel, max_len: int | None = None
) -> None:
    """Time a prompt chunk, the same chunk after as many cached tokens (attention over a
    longer context), a small chunk, decodes after long and short contexts, alone and
    together, a decode with a small chunk, and a small and the first chunk after a long
    context (within `max_len` tokens): the step-time fit's first steps (each term has one
    that moves it alone); the first chunk's rate is the tiers' prefill rate."""
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
    stats = runner.model.routing_stats
    if stats is not None:
        runner.model.attach_routing_stats(None)
    try:
        best = [_fastest(runner, seqs) for seqs, _ in probes]
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
