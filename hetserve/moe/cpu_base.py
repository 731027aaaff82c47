"""The shared part of the CPU expert backends: contract methods, optional dedicated thread, and
the library kernels' forward (routing sort, one linear pair per active expert).

`cpu_backends.py` (library kernels, registry entries) and `cpu_native.py` (the AVX2 kernel)
both build on `_CPUExperts`.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.nn.functional as F

from hetserve.errors import InvalidInputError
from hetserve.moe.experts import Activation, ExpertWeights, gated_activation


def _f32(w: torch.Tensor) -> torch.Tensor:
    """One expert's matrix as fp32 on the CPU (a no-op view when it already is)."""
    return w.to("cpu", torch.float32)


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def experts_thread(num_threads: int) -> ThreadPoolExecutor:
    """The process's one CPU-experts thread for `num_threads` (made at first use, kept for the
    process's life): every layer's backend built with that count runs on it. Its OpenMP team is
    the only one the experts wake: a thread per layer (as before) kept a team of num_threads
    per layer, so a 12-layer model on 16 threads held 192 OpenMP workers on 16 CPUs, libgomp
    then throttles their spin-wait, and each layer's call woke a sleeping team through the
    kernel (native/openmp.py has the measurements of that cost)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(num_threads)
        if pool is None:
            pool = _POOLS[num_threads] = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix=f"hetserve-cpu-experts-{num_threads}",
                initializer=torch.set_num_threads,
                initargs=(num_threads,),
            )
        return pool


class _CPUExperts:
    """Shared forward of the library kernels. Subclasses set `_pack(w[N, K]) -> object` and
    `_linear(x, packed)`; the native ones override `_load` and `_forward`.

    Per-expert packed weights sit in two Python lists built once, so forward does no weight
    work, and routing costs one host sync (the per-expert counts).
    """

    # (hidden, intermediate) columns the packed weights carry beyond the model's: zero weights
    # a kernel's shape rules need (TorchInt4Experts); forward pads the tokens to match.
    _pad: tuple[int, int] = (0, 0)

    def __init__(
        self,
        weights: ExpertWeights,
        activation: Activation = "silu",
        num_threads: int | None = None,
    ) -> None:
        self.glu = gated_activation(activation)
        self.activation = activation
        if num_threads is not None and num_threads < 1:
            raise InvalidInputError(f"num_threads must be >= 1, got {num_threads}")
        self.num_experts = weights.num_experts
        self.inter = weights.intermediate_size
        self.hidden = weights.hidden_size
        self.b13 = None if weights.b13 is None else _f32(weights.b13.detach()).contiguous()
        self.b2 = None if weights.b2 is None else _f32(weights.b2.detach()).contiguous()
        # Experts are converted one at a time (`weights.expert(e)`), never the whole layer at
        # once: a bf16 or quantized layer of 64 experts would otherwise need a transient 2+ GB
        # fp32 copy.
        self._load_weights(weights)
        # A dedicated worker, shared by every layer, whose intra-op pool is sized once:
        # torch's thread count is per OS thread, so the caller's (accelerator) thread keeps
        # its own setting.
        self._pool = None if num_threads is None else experts_thread(num_threads)

    # -- per-backend storage -------------------------------------------------------------
    def _load_weights(self, weights: ExpertWeights) -> None:
        weights._no_layout()  # the native kernels' bytes: only their own backend reads them
        self._load(weights)

    def _load(self, weights: ExpertWeights) -> None:
        self._w13, self._w2 = [], []
        for e in range(self.num_experts):
            w13, w2 = weights.expert(e)
            self._w13.append(self._pack(w13))
            self._w2.append(self._pack(w2))

    def _pack(self, w: torch.Tensor) -> object:
        raise NotImplementedError

    def _linear(self, x: torch.Tensor, packed: object) -> torch.Tensor:
        raise NotImplementedError

    def _expert_nbytes(self) -> int:
        """Bytes of one expert's weights as stored (w13 + w2, scales included)."""
        raise NotImplementedError

    # -- contract ------------------------------------------------------------------------
    def nbytes(self) -> int:
        return self.num_experts * self._expert_nbytes()

    def expert_nbytes(self) -> int:
        """Bytes one expert streams per call: what a token touching it reads from memory."""
        return self._expert_nbytes()

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if self._pool is not None:
            return self.submit(x, topk_weights, topk_ids).result()
        return self._forward(x, topk_weights, topk_ids)

    def submit(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Future:
        """Run forward on the dedicated pool (needs `num_threads`); the caller overlaps its own
        work and calls `.result()` when it needs the output."""
        if self._pool is None:
            raise InvalidInputError("submit() needs the backend built with num_threads=N")
        return self._pool.submit(self._forward, x, topk_weights, topk_ids)

    def close(self) -> None:
        """Stop using the experts thread (shared by the process's backends, so it stays)."""
        self._pool = None

    def _forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        out_device, out_dtype = x.device, x.dtype
        x = x.to("cpu", torch.float32)
        pad_h, pad_i = self._pad
        if pad_h:
            x = F.pad(x, (0, pad_h))
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1).to("cpu")
        order = torch.argsort(flat, stable=True)
        # The one host sync: per-expert counts decide which packed weights to run.
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // k
        xs = x.index_select(0, token_of)
        ws = topk_weights.reshape(-1).to("cpu", torch.float32).index_select(0, order)
        ws = ws.unsqueeze(1)
        inter, glu, lin, b13, b2 = self.inter + pad_i, self.glu, self._linear, self.b13, self.b2
        ys = []
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            end = start + n
            h = lin(xs[start:end], self._w13[e])  # gate+up fused: one matmul per expert
            if b13 is not None:
                h.add_(b13[e])
            a = glu(h[:, :inter], h[:, inter:]).mul_(ws[start:end])
            y = lin(a, self._w2[e])
            if b2 is not None:
                y.addcmul_(ws[start:end], b2[e])  # the router weight scales the bias too
            ys.append(y)
            start = end
        out = torch.zeros_like(x)
        if ys:
            out.index_add_(0, token_of, torch.cat(ys) if len(ys) > 1 else ys[0])
        if pad_h:
            out = out[:, : self.hidden]
        return out.to(out_device, out_dtype)
