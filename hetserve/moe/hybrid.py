"""Experts backends that span devices: hybrid execution of one routed-experts module.

Who uses them: `model/hybrid_plan.py` wraps a layer's backend in them when its placement puts
the experts elsewhere than the activations (`DeviceBridge`) or keeps the hottest experts on the
accelerator (`HotExperts`). They follow the `ExpertsBackend` contract (`experts.py`): same
inputs and outputs as the backend they wrap; failures are the wrapped backend's.
"""

from __future__ import annotations

import threading

import torch

from hetserve.moe.experts import ExpertsBackend, ExpertWeights, TorchExperts


class DeviceBridge:
    """Runs a backend that lives on another device than the activations. CUDA -> host copies go
    through reusable pinned buffers so the copy back can be asynchronous.

    The buffers are per calling thread: with deferral a layer's late experts (the deferral
    thread) and its on-time ones (the engine or the overlap thread) are in the same bridge at
    once, and one set of buffers let one call's weights, ids or result be overwritten by the
    other's while a kernel or an asynchronous copy still read them."""

    remote = True

    def __init__(self, inner: ExpertsBackend, device: torch.device) -> None:
        self.inner, self.device = inner, device
        self._local = threading.local()

    def nbytes(self) -> int:
        return self.inner.nbytes()

    def _pinned_copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        pinned = getattr(self._local, "pinned", None)
        if pinned is None:
            pinned = self._local.pinned = {}
        buf = pinned.get(key)
        if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
            buf = torch.empty(max(t.numel(), 1), dtype=t.dtype, pin_memory=True)
            pinned[key] = buf
        view = buf[: t.numel()].view(t.shape)
        view.copy_(t, non_blocking=True)
        return view

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
        if x.device == self.device:
            return self.inner.forward(x, topk_weights, topk_ids)
        if x.is_cuda and self.device.type == "cpu":
            xs = self._pinned_copy("x", x)
            ws = self._pinned_copy("w", topk_weights)
            ids = self._pinned_copy("ids", topk_ids)
            # Wait for the copies, not the whole stream: what is queued after them (the shared
            # experts or the next layer another thread launched) runs on while the host works.
            landed = torch.cuda.Event()
            landed.record(torch.cuda.current_stream(x.device))
            landed.synchronize()
            y = self.inner.forward(xs, ws, ids)
            # This thread's next call waits for its own copies, queued after this one on the
            # same stream, before it writes the buffer again: this copy is safe.
            return self._pinned_copy("y", y).to(x.device, non_blocking=True)
        dev = self.device
        return self.inner.forward(x.to(dev), topk_weights.to(dev), topk_ids.to(dev)).to(x.device)


class HotExperts:
    """The hottest experts of a layer on the accelerator (torch backend), the rest on `cold`."""

    remote = True

    def __init__(
        self,
        cold: ExpertsBackend,
        weights: ExpertWeights,
        hot: list[int],
        device: torch.device,
        activation: str,
    ) -> None:
        idx = torch.tensor(hot, dtype=torch.long)
        self.cold, self.hot = cold, TorchExperts(weights.subset(hot, device), activation)
        self.remap = torch.full((weights.num_experts,), -1, dtype=torch.long, device=device)
        self.remap[idx.to(device)] = torch.arange(len(hot), device=device)

    def nbytes(self) -> int:
        return self.cold.nbytes() + self.hot.nbytes()

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
        # Every (token, slot) pair becomes a one-expert row on the side that holds its expert.
        k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1).to(self.remap.device)
        local = self.remap[flat_ids]
        out = torch.zeros_like(x)
        for mask, backend, ids in ((local >= 0, self.hot, local), (local < 0, self.cold, flat_ids)):
            pairs = mask.nonzero().squeeze(1)
            if pairs.numel() == 0:
                continue
            tokens = (pairs // k).to(x.device)
            y = backend.forward(
                x[tokens],
                topk_weights.reshape(-1)[pairs.to(x.device)].unsqueeze(1),
                ids[pairs].unsqueeze(1).to(x.device),
            )
            out.index_add_(0, tokens, y.to(x.dtype))
        return out
