"""HostSwap: preemption by swap's host copies (the `kv/swap.py` protocol).

Who calls it: the scheduler, on the engine thread, when it preempts a request (`swap_out`) and
when it admits it again (`swap_in`). A request's copies are one tensor per KV tensor
([its blocks, block_size, ...]) and, for a linear-attention model, its state slot's tensors;
on an accelerator they live in host memory. Bounded by `capacity_bytes`: a request that does not
fit is refused (False) and the scheduler recomputes it instead.

A swap-in writes into blocks (and a state slot) the same scheduling pass handed out, which may
be cached ones whose bytes the KV tiers have not staged yet (that happens after scheduling, before
the forward): `before_write` (the tiers' write-back capture) runs first, so the store never
receives the swapped-in bytes under an evicted block's identity.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hetserve.kv.paged import PagedKVCache
from hetserve.kv.state import StateCache


class HostSwap:
    def __init__(
        self,
        kv: PagedKVCache,
        state: StateCache | None,
        capacity_bytes: int,
        before_write: Callable[[], None] | None = None,
    ) -> None:
        self.state = state
        self.before_write = before_write
        self.capacity = capacity_bytes
        bs, nb = kv.block_size, kv.num_blocks
        # Each KV tensor seen as [blocks, block_size, ...]: a block is one index.
        self.tensors = [t.view(nb, bs, *t.shape[1:]) for layer in kv.layers for t in layer]
        self.block_bytes = sum(t[0].nbytes for t in self.tensors)
        self.slot_bytes = 0 if state is None else sum(t.nbytes for t in state.slot_parts(0))
        self.used = 0
        self.swaps_out = self.swaps_in = 0
        self._held: dict[str, tuple[list[torch.Tensor], list[torch.Tensor], int]] = {}

    def swap_out(self, request_id: str, block_ids: list[int], state_slot: int | None) -> bool:
        need = len(block_ids) * self.block_bytes + (
            self.slot_bytes if state_slot is not None else 0
        )
        if not block_ids or self.used + need > self.capacity or request_id in self._held:
            return False
        ids = torch.tensor(block_ids, device=self.tensors[0].device)
        kv = [t.index_select(0, ids).to("cpu") for t in self.tensors]
        st = []
        if state_slot is not None and self.state is not None:
            st = [t.to("cpu", copy=True) for t in self.state.slot_parts(state_slot)]
        self._held[request_id] = (kv, st, need)
        self.used += need
        self.swaps_out += 1
        return True

    def swap_in(self, request_id: str, block_ids: list[int], state_slot: int | None) -> None:
        if self.before_write is not None:
            self.before_write()
        kv, st, size = self._held.pop(request_id)
        self.used -= size
        self.swaps_in += 1
        ids = torch.tensor(block_ids[: kv[0].shape[0]], device=self.tensors[0].device)
        for t, saved in zip(self.tensors, kv, strict=True):
            t.index_copy_(0, ids, saved.to(t.device))
        if st:
            assert state_slot is not None and self.state is not None
            for dst, src in zip(self.state.slot_parts(state_slot), st, strict=True):
                dst.copy_(src)

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def drop(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            self.used -= held[2]

    def swapped(self) -> set[str]:
        return set(self._held)
