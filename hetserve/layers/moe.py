"""The MoE block the model families use: router -> routed experts (+ shared experts).

`FusedExperts` holds the routed experts' weights (names `w13`, `w2`) and delegates compute to an
`ExpertsBackend` from the registry; placement swaps the backend without touching model code.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from torch import nn

from hetserve.errors import InvalidInputError
from hetserve.moe.experts import Activation, ExpertsBackend, ExpertWeights, create_backend
from hetserve.moe.router import RouterConfig, TopKRouter
from hetserve.quant.kernel_file import KernelLayout
from hetserve.quant.packed import PackedExperts

if TYPE_CHECKING:
    from hetserve.layers.attention import ForwardContext

_POOLS: dict[str, ThreadPoolExecutor] = {}


def _pool(name: str) -> ThreadPoolExecutor:
    # One worker each: deferred work of layer L must finish before layer L+1 defers its own,
    # and one layer's routed experts run at a time.
    if name not in _POOLS:
        _POOLS[name] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hetserve-{name}")
    return _POOLS[name]


def _deferral_pool() -> ThreadPoolExecutor:
    return _pool("deferred")


def _overlap_pool() -> ThreadPoolExecutor:
    return _pool("routed")


# Fewest experts a token computes on time in a layer that defers: with one, a token's layer
# output would rest on a single expert, which is where quality falls off.
MIN_ON_TIME_EXPERTS = 2


def max_deferral(top_k: int) -> int:
    """The most experts per token a layer may defer (0 where top_k <= 2)."""
    return max(0, top_k - MIN_ON_TIME_EXPERTS)


def _run_experts(experts, x, weights, ids, phase, stream=None) -> torch.Tensor:
    """Routed experts, on a side thread for deferral or overlap. `stream`: the submitting
    thread's CUDA stream. Current streams are per thread, so without it the side thread's
    copies of the router's output would be ordered on the default stream, not after the kernels
    that compute it (seen on an H200: a graph capture's warm-up, on a side stream, handed the
    host experts ids read before they were written)."""
    # Both are thread-local: the engine thread's inference mode and stream do not carry over.
    with torch.inference_mode(), torch.cuda.stream(stream):
        return experts(x, weights, ids, phase)


def _submit(pool: ThreadPoolExecutor, experts, x, weights, ids, phase) -> Future:
    stream = torch.cuda.current_stream(x.device) if x.is_cuda else None
    return pool.submit(_run_experts, experts, x, weights, ids, phase, stream)


class FusedExperts(nn.Module):
    """Routed experts: dense w13 [E, 2I, H] and w2 [E, H, I] (+ biases b13, b2 where the family
    has them), or, for a checkpoint that publishes its experts quantized, `packed` (the loader
    sets it; w13 and w2 are then empty)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        activation: Activation = "silu",
        bias: bool = False,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden
        self.intermediate_size = inter
        self.activation = activation
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * inter)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        self.packed: PackedExperts | None = None
        self.layout: KernelLayout | None = None  # mapped kernel-layout bytes (model/converted)
        self.backend_name: str | None = None
        self._backend: ExpertsBackend | None = None
        self._phase_backends: dict[str, ExpertsBackend] | None = None
        self.routing_stats = None  # a RoutingStats to record routing into, or None
        self.layer_index = -1  # set by the model; names the layer in routing statistics

    def weights(self) -> ExpertWeights:
        bias = [None if b is None else b.data for b in (self.b13, self.b2)]
        if self.layout is not None:
            return ExpertWeights(None, None, *bias, layout=self.layout)
        if self.packed is not None:
            return ExpertWeights(None, None, *bias, packed=self.packed)
        return ExpertWeights(self.w13.data, self.w2.data, *bias)

    def expect_packed(self) -> None:
        """The checkpoint stores these experts quantized: no dense weights get allocated (the
        loader assembles `packed` instead)."""
        self.w13 = nn.Parameter(self.w13.new_empty(0), requires_grad=False)
        self.w2 = nn.Parameter(self.w2.new_empty(0), requires_grad=False)

    def materialize(self, device: torch.device) -> None:
        """Allocate w13 and w2 left on the meta device by a streaming load (model/loader.py):
        one layer's dense experts exist only between its first tensor and its backend."""
        for pname in ("w13", "w2"):
            p = getattr(self, pname)
            if p.is_meta:
                empty = torch.empty(p.shape, dtype=p.dtype, device=device)
                setattr(self, pname, nn.Parameter(empty, requires_grad=False))

    def release_weights(self) -> None:
        """Drop the loaded weights once backends hold their own copies (quantized/repacked)."""
        self.w13 = nn.Parameter(self.w13.new_empty(0), requires_grad=False)
        self.w2 = nn.Parameter(self.w2.new_empty(0), requires_grad=False)
        self.packed = None
        self.layout = None

    def set_backend(self, name: str, **options) -> None:
        """Build the compute backend; called once weights are loaded (and again on re-placement)."""
        self._backend = create_backend(name, self.weights(), activation=self.activation, **options)
        self._phase_backends = None
        self.backend_name = name

    def is_remote(self, phase: str) -> bool:
        """Whether this phase's backend runs on another device than the activations."""
        backends = self._phase_backends
        return backends is not None and getattr(backends[phase], "remote", False)

    def set_phase_backends(self, backends: dict[str, ExpertsBackend]) -> None:
        """Placement: one backend per phase ("prefill", "decode"); they may be the same."""
        self._phase_backends = dict(backends)
        self._backend = backends["decode"]
        self.backend_name = "placed"

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        phase: str = "prefill",
    ) -> torch.Tensor:
        if self.routing_stats is not None:
            self.routing_stats.add(self.layer_index, topk_ids, self.num_experts)
        if self._phase_backends is not None:
            return self._phase_backends[phase].forward(x, topk_weights, topk_ids)
        if self._backend is None:
            self.set_backend("torch")
        return self._backend.forward(x, topk_weights, topk_ids)


class SparseMoE(nn.Module):
    """Routed experts plus optional shared experts (optionally sigmoid-gated, Qwen2-MoE)."""

    def __init__(
        self,
        hidden: int,
        router: RouterConfig,
        inter: int,
        activation: Activation = "silu",
        shared: nn.Module | None = None,
        shared_name: str = "shared_experts",
        shared_gate: bool = False,
        expert_bias: bool = False,
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden, router)
        self.experts = FusedExperts(router.num_experts, hidden, inter, activation, expert_bias)
        self._shared_name = shared_name if shared is not None else None
        if shared is not None:
            setattr(self, shared_name, shared)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_gate else None
        self.num_deferred = 0

    def set_deferral(self, num_deferred: int) -> int:
        """Defer up to `num_deferred` experts per token at decode; returns the number kept,
        clamped so every token keeps at least two on-time experts (top_k - 2; 0 at top_k <= 2)."""
        if num_deferred < 0:
            raise InvalidInputError("max deferred experts per token must be >= 0")
        self.num_deferred = min(num_deferred, max_deferral(self.gate.cfg.top_k))
        return self.num_deferred

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        phase = "decode" if ctx is not None and ctx.meta.decode_only else "prefill"
        d = self.num_deferred
        # Prefill never defers: its tokens write the KV every later token reads, so an error
        # there would persist; a decode token's late experts only shift its own residual.
        if d and ctx is not None and phase == "decode":
            # The d lowest-weighted experts of each token run on the deferral thread while the
            # next layer computes; their sum joins the residual stream after that layer.
            order = topk_weights.argsort(dim=-1, descending=True)
            topk_weights, topk_ids = topk_weights.gather(1, order), topk_ids.gather(1, order)
            late_w, late_ids = topk_weights[:, -d:], topk_ids[:, -d:]
            topk_weights, topk_ids = topk_weights[:, :-d], topk_ids[:, :-d]
            ctx.deferred = _submit(_deferral_pool(), self.experts, x, late_w, late_ids, phase)
        host_call = None if ctx is None else ctx.host_call
        if host_call is not None:
            # Capturing a CUDA graph: routed experts are either on the host or data-dependent
            # (the torch backend reads its per-expert counts on the host), so they run between
            # graph segments.
            return self._split_at_host(host_call, x, topk_weights, topk_ids, phase)
        if self._shared_name is None:
            return self.experts(x, topk_weights, topk_ids, phase)
        routed = None
        if self.experts.is_remote(phase):
            # Routed experts on the host thread pool while the shared experts run here.
            routed = _submit(_overlap_pool(), self.experts, x, topk_weights, topk_ids, phase)
        shared = self._shared(x)
        if routed is None:
            return self.experts(x, topk_weights, topk_ids, phase) + shared
        return routed.result() + shared

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        assert self._shared_name is not None
        shared = getattr(self, self._shared_name)(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return shared

    def _split_at_host(self, host_call, x, topk_weights, topk_ids, phase: str) -> torch.Tensor:
        # Shared experts first, so they sit in the graph before the split; the host call then
        # runs the routed experts eagerly between two graph replays.
        shared = None if self._shared_name is None else self._shared(x)

        def routed(x_, w_, ids_):
            return _run_experts(self.experts, x_, w_, ids_, phase)

        out = host_call(routed, x, x, topk_weights, topk_ids)
        return out if shared is None else out + shared
