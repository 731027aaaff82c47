"""Mooncake trace replay: hash ids become fixed token blocks, so shared prefixes really are shared.

Trace format (one JSON object a line, sorted by time):
`{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}` where hash id i is
the prefix hash of the i-th 512-token block. See ../shared/data/mooncake/README.md. hetserve's
request logs are the same format with a `block_size`; `hetserve.sim.trace` reads both.
"""

from __future__ import annotations

import math

from hetserve.bench.model_facts import TokenSpace
from hetserve.bench.serve.workload import (
    BenchRequest,
    BlockTokens,
    Workload,
    fit_lengths,
    scale_factor,
)
from hetserve.errors import InvalidInputError
from hetserve.sim.trace import read_trace


def _read_trace(path: str) -> list[dict]:
    """The trace's records (parsed and checked by the simulator's reader, the one parser of
    this format) as the dicts the workload is built from."""
    return [
        {
            "timestamp": r.timestamp_ms,
            "input_length": r.input_length,
            "output_length": r.output_length,
            "hash_ids": list(r.hash_ids),
            "block_size": r.block_size,  # 512 in Mooncake's traces; the engine's in our logs
        }
        for r in read_trace(path, param="--dataset-path")
    ]


def trace_workload(
    path: str,
    num_prompts: int | None,
    space: TokenSpace,
    max_model_len: int | None = None,
    fit_mode: str = "clip",
) -> Workload:
    """The first `num_prompts` records (all when None) as token-id requests with arrival times."""
    rows = _read_trace(path)[:num_prompts]
    if not rows:
        raise InvalidInputError(f"--dataset-path: no records in {path}")
    requests = [
        BenchRequest(
            prompt_len=r["input_length"],
            output_len=r["output_length"],
            hash_ids=r["hash_ids"],
            arrival_s=r["timestamp"] / 1000.0,
        )
        for r in rows
    ]
    trace_block = block_size = rows[0]["block_size"]
    notes: list[str] = []
    if max_model_len is not None and fit_mode == "scale":
        # Scale the block too, so every id still covers the same share of each prompt and the
        # sharing structure of the trace survives; one integer block size sets the factor.
        factor = scale_factor(requests, max_model_len)
        block_size = max(1, math.floor(trace_block * factor))
        notes += fit_lengths(requests, max_model_len, "scale", block_size / trace_block)
    else:
        notes += fit_lengths(requests, max_model_len, fit_mode)
    if block_size != trace_block:
        notes.append(f"trace blocks scaled to {block_size} tokens per hash id")
    return Workload(
        "mooncake-trace",
        [[r] for r in requests],
        ignore_eos=True,
        notes=notes,
        block_tokens=BlockTokens(block_size, space),
        prefix_reuse=perfect_cache_reuse(requests, block_size),
    )


def perfect_cache_reuse(requests: list[BenchRequest], block_size: int) -> dict[str, float]:
    """Blocks (and tokens) an unbounded prefix cache would hit, replaying requests in order.

    A seen id at position i means the whole prefix up to it was seen (ids are chained prefix
    hashes), so a set of seen ids is a perfect cache.
    """
    seen: set[int] = set()
    blocks = hits = tokens = hit_tokens = 0
    for r in requests:
        assert r.hash_ids is not None
        for i, h in enumerate(r.hash_ids[: math.ceil(r.prompt_len / block_size)]):
            n = min(block_size, r.prompt_len - i * block_size)
            blocks, tokens = blocks + 1, tokens + n
            if h in seen:
                hits, hit_tokens = hits + 1, hit_tokens + n
            seen.add(h)
    return {
        "blocks_total": blocks,
        "blocks_hit": hits,
        "block_hit_ratio": hits / blocks if blocks else 0.0,
        "prompt_tokens_total": tokens,
        "prompt_tokens_hit": hit_tokens,
        "token_hit_ratio": hit_tokens / tokens if tokens else 0.0,
    }
