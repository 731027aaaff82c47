"""ModelRunner: turns a batch of (new tokens, KV blocks) into hidden states and logits.

It owns the model and the paged KV tensors; which slots a sequence uses is decided by the caller
(the scheduler's block tables, through the engine's `StepExecutor`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from hetserve.engine.decode_graphs import DecodeGraphs
from hetserve.kv.cache_spec import has_state, paged_layout, state_layout
from hetserve.kv.paged import PagedKVCache
from hetserve.kv.state import StateCache
from hetserve.layers.attention import ForwardContext, build_metadata
from hetserve.layers.linear_attention import build_state_batch
from hetserve.layers.lora import LoRABatch
from hetserve.model import fused_decode
from hetserve.model.base import CausalLM


@dataclass(frozen=True)
class GraphOptions:
    """Decode graphs for a runner: buckets up to `max_batch` sequences, contexts up to
    `max_blocks` blocks; `capture` False runs the same buffers eagerly (CPU)."""

    max_batch: int
    max_blocks: int
    capture: bool


@dataclass
class SeqInput:
    token_ids: list[int]  # the tokens to compute in this forward
    num_computed: int  # tokens of this sequence already in the KV cache
    block_ids: list[int]  # KV blocks covering num_computed + len(token_ids) tokens
    lora_slot: int | None = None  # the LoRA slot its adapter is in (None: the base model)
    state_slot: int | None = None  # its linear-attention state slot (models with such layers)
    state_resume: int | None = None  # a prefix checkpoint to continue from (copied in first)
    # Prefix checkpoints to take in this forward: (tokens into token_ids, checkpoint slot).
    state_saves: tuple[tuple[int, int], ...] = ()
    # Its tokens attend as decodes, each over the context up to itself (a speculative decode's
    # last token and drafts: the same kernels, the same numbers as decoding them one by one).
    as_decodes: bool = False


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        lora_batch: LoRABatch | None = None,
        num_state_slots: int = 0,
        kv_dtype: torch.dtype | None = None,
        graphs: GraphOptions | None = None,
    ) -> None:
        self.model = model
        model.fused_step = fused_decode.run  # declines wherever it does not apply
        self.lora_batch = lora_batch  # the model's LoRA layers read it (None: no LoRA layers)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        specs = model.cache_specs()
        self.kv = PagedKVCache(
            paged_layout(specs), num_blocks, block_size, kv_dtype or self.dtype, self.device
        )
        # Linear-attention layers keep a fixed-size state per sequence beside the paged KV.
        self.state: StateCache | None = None
        if has_state(specs):
            self.state = StateCache(state_layout(specs), num_state_slots, self.device)
        # Decode batches through static per-bucket buffers (CUDA graphs on CUDA); none with
        # LoRA layers or linear-attention state, whose per-forward batches they do not carry.
        self.graphs: DecodeGraphs | None = None
        if graphs is not None and lora_batch is None and self.state is None:
            self.graphs = DecodeGraphs(
                model, self.kv, block_size, graphs.max_batch, graphs.max_blocks, graphs.capture
            )

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput]) -> torch.Tensor:
        """Hidden states [sum(len(token_ids)), H] for every new token, sequences concatenated."""
        if self.graphs is not None and all(len(s.token_ids) == 1 for s in seqs):
            hidden = self.graphs.run([(s.token_ids[0], s.num_computed, s.block_ids) for s in seqs])
            if hidden is not None:
                return hidden
        meta = build_metadata(
            [(s.num_computed, len(s.token_ids), s.block_ids) for s in seqs],
            self.block_size,
            self.device,
            self.model.sliding_window,
            frozenset(i for i, s in enumerate(seqs) if s.as_decodes),
        )
        ids = torch.tensor([t for s in seqs for t in s.token_ids], device=self.device)
        ctx = ForwardContext(meta, self.kv)
        if self.state is not None:
            for s in seqs:
                if s.state_resume is not None:
                    assert s.state_slot is not None
                    self.state.copy_slot(s.state_resume, s.state_slot)
            ctx.state_cache = self.state
            ctx.states = build_state_batch(
                [(s.num_computed, len(s.token_ids), s.state_slot, s.state_saves) for s in seqs],
                self.device,
            )
        if self.lora_batch is None:
            return self.model(ids, ctx)
        starts = list(itertools.accumulate((len(s.token_ids) for s in seqs), initial=0))
        self.lora_batch.set(
            [(starts[i], len(s.token_ids), s.lora_slot) for i, s in enumerate(seqs)],
            [span.q_start for span in meta.seqs],
        )
        try:
            return self.model(ids, ctx)
        finally:
            self.lora_batch.clear()

    @torch.inference_mode()
    def forward_layers(
        self, seq: SeqInput, start: int, stop: int, hidden: torch.Tensor | None
    ) -> torch.Tensor:
        """Decoder layers [start, stop) of one prompt chunk (a layer slice): from its tokens'
        embeddings at 0, else from `hidden`, what layer `start - 1` left; writes those layers'
        K/V. Returns the hidden states after `stop` (normed after the last layer). Not for
        models with linear-attention state or LoRA layers (the scheduler slices none)."""
        assert self.state is None and self.lora_batch is None
        meta = build_metadata(
            [(seq.num_computed, len(seq.token_ids), seq.block_ids)],
            self.block_size,
            self.device,
            self.model.sliding_window,
        )
        ids = torch.tensor(seq.token_ids, device=self.device)
        return self.model.forward_layers(ids, ForwardContext(meta, self.kv), start, stop, hidden)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
