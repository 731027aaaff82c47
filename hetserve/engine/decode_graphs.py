"""Decode forwards from static buffers, one per batch-size bucket; replayed as CUDA graphs on CUDA.

Who calls it: `ModelRunner.forward`, for a batch where every sequence computes one token, when
the engine built the runner with graphs (CUDA, no `--enforce-eager`, no LoRA layers, no
linear-attention state). `run` returns None for a batch it does not take (more sequences than
the largest bucket, a context past `max_blocks` blocks, expert deferral or routing statistics
on: their side threads and host-side bookkeeping cannot sit inside a graph); the runner then
runs the batch eagerly. A capture error propagates from the first forward of that bucket.

A batch of n sequences is padded to its bucket b >= n: padding rows read token 0, attend one
key in the null block (block 0, never handed out) and write their K/V there, so they touch no
sequence's cache; the first n rows of the output are the batch's. The block tables are padded
too, to a width bucket: the smallest power of two of blocks (at least MIN_WIDTH) holding the
longest context, never past `max_blocks`. The accelerator's attention gathers (and MLA without
absorption expands) every key the table's width spans, so one width of `max_blocks` made every
step attend the whole model length (seen on an H200: batch-8 graphs at 0.82x eager). Each
(batch bucket, width bucket) pair is captured on first use; all share one memory pool (one
replay runs at a time, and each output is copied out before the next).

Routed experts split the forward: those on the host cannot be captured, and those on the
accelerator (the torch backend) size their work from per-expert counts read on the host. The
model calls `ForwardContext.host_call` there, which on CUDA ends the graph being captured,
records the call with its (static) inputs and a static output buffer, and begins the next
graph. A replay runs
graph 0, host call 0, graph 1, ... so the accelerator's part runs as graphs with no break
inside a segment. On CPU (`capture=False`) the same buffers and padding run eagerly, which is
what tests check against the unpadded eager forward here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hetserve.layers.attention import AttentionMetadata, DecodeBatch, ForwardContext

NULL_BLOCK = 0  # block 0 of the paged cache is never handed out (kv/block_pool.py)


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (and max_batch itself): padding
    wastes at most 7 rows past 8 while keeping the number of captured graphs small."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += list(range(8, max_batch, 8))
    return sorted({*sizes, max_batch})


def pick_bucket(buckets: Sequence[int], n: int) -> int | None:
    """The smallest bucket holding n sequences (None: more than the largest)."""
    return next((b for b in buckets if b >= n), None)


MIN_WIDTH = 16  # blocks: the narrowest table width captured


def pick_width(max_blocks: int, blocks: int) -> int | None:
    """The table width for contexts of up to `blocks` blocks: the smallest power of two >= it
    (at least MIN_WIDTH), capped at max_blocks (None: past max_blocks)."""
    if blocks > max_blocks:
        return None
    width = MIN_WIDTH
    while width < blocks:
        width *= 2
    return min(width, max_blocks)


class GraphLike(Protocol):
    """What a split capture needs of `torch.cuda.CUDAGraph` (a fake one in tests)."""

    def capture_begin(self, pool: Any = None) -> None: ...

    def capture_end(self) -> None: ...

    def replay(self) -> None: ...


@dataclass
class HostStep:
    """One host call between two graphs: fn(*inputs) copied into `out` at every replay."""

    fn: Callable[..., torch.Tensor]
    inputs: tuple[Any, ...]
    out: torch.Tensor


@dataclass
class SplitGraph:
    """A forward captured as graphs separated by host calls, replayed in capture order."""

    new_graph: Callable[[], GraphLike]
    pool: Any = None
    steps: list[GraphLike | HostStep] = field(default_factory=list)
    _open: GraphLike | None = None

    def begin(self) -> None:
        self._open = self.new_graph()
        self._open.capture_begin(pool=self.pool)

    def host_call(self, fn: Callable[..., torch.Tensor], like: torch.Tensor, *inputs: Any):
        """Inside a capture: close the open graph, record fn and its static inputs, open the
        next graph; returns the static buffer fn's result lands in (shaped like `like`)."""
        assert self._open is not None, "host_call outside a capture"
        self._open.capture_end()
        self.steps.append(self._open)
        out = torch.empty_like(like)  # allocated between captures: outlives every replay
        self.steps.append(HostStep(fn, inputs, out))
        self.begin()
        return out

    def end(self) -> None:
        assert self._open is not None
        self._open.capture_end()
        self.steps.append(self._open)
        self._open = None

    def replay(self) -> None:
        for step in self.steps:
            if isinstance(step, HostStep):
                # The host backend copies its inputs out (a stream sync) and its result back.
                step.out.copy_(step.fn(*step.inputs))
            else:
                step.replay()


class StaticDecodeInputs:
    """The decode batch's tensors for one bucket, allocated once and filled in place."""

    def __init__(self, bucket: int, width: int, block_size: int, device) -> None:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.long, device=device)

        self.bucket, self.block_size = bucket, block_size
        self.ids, self.positions, self.slots = zeros(bucket), zeros(bucket), zeros(bucket)
        self.tables, self.lens = zeros(bucket, width), torch.ones_like(zeros(bucket))
        self.rows = torch.arange(bucket, device=device)

    def fill(self, seqs: Sequence[tuple[int, int, list[int]]]) -> None:
        """seqs: (token, tokens already cached, block ids) per sequence; the rest is padding.
        Built on the host and copied in one transfer per tensor."""
        b, bs, width = self.bucket, self.block_size, self.tables.shape[1]
        ids, lens = [0] * b, [1] * b
        tables = torch.full((b, width), NULL_BLOCK, dtype=torch.long)
        for i, (token, computed, blocks) in enumerate(seqs):
            ids[i], lens[i] = token, computed + 1
            tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        lens_t = torch.tensor(lens, dtype=torch.long)
        last = lens_t - 1
        slots = tables.gather(1, (last // bs).unsqueeze(1)).squeeze(1) * bs + last % bs
        for dst, src in (
            (self.ids, torch.tensor(ids)),
            (self.lens, lens_t),
            (self.positions, last),
            (self.slots, slots),
            (self.tables, tables),
        ):
            dst.copy_(src, non_blocking=True)  # fmt: skip

    def context(self, kv, window: int | None) -> ForwardContext:
        decode = DecodeBatch(self.rows, self.tables, self.lens, self.block_size, window)
        # A new view of the static positions per forward: rotary layers look their angles up
        # once per positions tensor (by identity), and this buffer is refilled in place, so the
        # buffer itself would hand every step the first step's angles (seen on an H200: decode
        # through CUDA graphs left eager's greedy tokens at the second step).
        meta = AttentionMetadata(self.positions.view(-1), self.slots, [], decode, window)
        return ForwardContext(meta, kv)


class DecodeGraphs:
    """Decode forwards through per-bucket static buffers; captured as split graphs on CUDA."""

    def __init__(
        self, model, kv, block_size: int, max_batch: int, max_blocks: int, capture: bool
    ) -> None:
        self.model, self.kv, self.block_size = model, kv, block_size
        self.buckets = bucket_sizes(max_batch)
        self.max_blocks, self.capture = max_blocks, capture
        self.device = next(model.parameters()).device
        self._inputs: dict[tuple[int, int], StaticDecodeInputs] = {}
        self._graphs: dict[tuple[int, int], tuple[SplitGraph, torch.Tensor]] = {}
        self._pool: Any = None  # one memory pool for every capture
        self.forwards = 0  # decode forwards served here (replays on CUDA)

    def _model_declines(self) -> bool:
        # Deferral hands futures between layers and routing statistics count on the host:
        # neither can be replayed from a graph.
        model = self.model
        return model.routing_stats is not None or any(m.num_deferred for m in model.moe_layers())

    def run(self, seqs: Sequence[tuple[int, int, list[int]]]) -> torch.Tensor | None:
        """Hidden states [n, H] of n decoding sequences ((token, cached, blocks) each), or None
        where this batch runs eagerly instead (see the module docstring)."""
        bucket = pick_bucket(self.buckets, len(seqs))
        width = pick_width(self.max_blocks, max((len(b) for _, _, b in seqs), default=0))
        if bucket is None or width is None or self._model_declines():
            return None
        key = (bucket, width)
        inputs = self._inputs.get(key)
        if inputs is None:
            inputs = StaticDecodeInputs(bucket, width, self.block_size, self.device)
            self._inputs[key] = inputs
        inputs.fill(seqs)
        window = self.model.sliding_window
        if not self.capture:
            hidden = self.model(inputs.ids, inputs.context(self.kv, window))
        else:
            captured = self._graphs.get(key)
            if captured is None:
                captured = self._capture(inputs, window)
                self._graphs[key] = captured
            captured[0].replay()
            # The graph's output buffer is overwritten by the next replay: hand out a copy.
            hidden = captured[1][: len(seqs)].clone()
        self.forwards += 1
        return hidden[: len(seqs)]

    def _capture(self, inputs: StaticDecodeInputs, window) -> tuple[SplitGraph, torch.Tensor]:
        # Capture runs on a side stream (CUDA graphs cannot capture the legacy default
        # stream); two eager warm-ups first so lazy initialisation (cuBLAS handles, autotuned
        # kernels, the host backends' pinned buffers) stays out of the graphs. They compute
        # this very batch, so the K/V they write is what the replay writes again.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model(inputs.ids, inputs.context(self.kv, window))
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            split = SplitGraph(torch.cuda.CUDAGraph, self._pool)
            ctx = inputs.context(self.kv, window)
            ctx.host_call = split.host_call
            split.begin()
            hidden = self.model(inputs.ids, ctx)
            split.end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return split, hidden
