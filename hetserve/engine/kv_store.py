"""The engine's KV cache behind a KV store: block identity, block bytes, and start-up.

`open_tiers` (called once by EngineCore) opens the store, checks it (write, read back, time a
probe block; one-line error if it fails), puts what the probe measured into the engine's cost
model, and returns the tier component (`kv/tiers.py`) with a one-line summary of the active
tiers.

BlockIO: the bytes of one KV block as the store's multi-part buffers.

The engine keeps one KV tensor per layer and entry (`kv/paged.py`: [num_slots, ...]), so a
block's bytes are `num_layers x entries` contiguous row ranges; a store object holds them all,
page-first (layer by layer, entry by entry), MLA's latent rows as they are cached.

Called by the KV tiers' worker threads. On CPU the parts are views of the KV tensors themselves
(a load writes straight into the cache, a save reads straight from it). On CUDA they are
reusable pinned host buffers, copied to or from the device on a side stream that is synchronized
before the load is reported done or the save's buffers are handed over.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hetserve.config import KVLoad, KVSave
from hetserve.kv.manager import KVCacheManager
from hetserve.kv.paged import PagedKVCache
from hetserve.kv.state import StateCache
from hetserve.kv.state_tiers import StateIO
from hetserve.kv.tier_policy import CostModel, TierCost
from hetserve.kv.tiers import TierManager
from hetserve.store.api import as_memoryview

log = logging.getLogger(__name__)

# Bump when the bytes of a stored block change meaning (part order, row layout): old objects
# then simply stop matching (the version is part of every block's identity).
KV_LAYOUT_VERSION = 1


def kv_identity(
    model_dir: Path, cache: PagedKVCache, salt: str = "", state: StateCache | None = None
) -> bytes:
    """The root seed of every block hash: what makes stored KV reusable by this engine. It
    covers the checkpoint (its config and weight files), the KV dtype and layout, the block
    size, a linear-attention model's state layout (its checkpoints are keyed from the block
    hashes) and an operator's salt; it is the same in every process and after restarts."""
    h = hashlib.sha256(f"hetserve-kv/v{KV_LAYOUT_VERSION}".encode())
    config = model_dir / "config.json"
    h.update(config.read_bytes() if config.is_file() else str(model_dir).encode())
    weights = sorted(p for p in model_dir.glob("*") if p.suffix in (".safetensors", ".gguf"))
    h.update(json.dumps([(p.name, p.stat().st_size) for p in weights]).encode())
    layout = [[(tuple(t.shape[1:]), str(t.dtype)) for t in layer] for layer in cache.layers]
    if cache.quantized:  # an 8-bit cache: its scales' layout is part of what a block's bytes mean
        layout += [[(tuple(t.shape[1:]), str(t.dtype)) for t in layer] for layer in cache.scales]
    h.update(json.dumps([cache.block_size, layout, salt]).encode())
    if state is not None:  # models without a state keep the seeds they always had
        h.update(json.dumps(["state", [[list(s) for s in e] for e in state.layout]]).encode())
    return h.digest()


class BlockIO:
    # Room for copies of evicted blocks waiting to be saved (write-back); at least this many.
    STAGING_BYTES = 128 << 20
    MIN_STAGING_SLOTS = 16

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.bs = cache.block_size
        # The data, then (8-bit caches) the scales: a block's bytes carry its scales.
        self.tensors = cache.parts()
        self.num_parts = len(self.tensors)
        self.part_bytes = [t[: self.bs].nbytes for t in self.tensors]
        self.bytes_per_block = sum(self.part_bytes)
        self.on_device = self.tensors[0].device.type != "cpu"
        self.staging_slots = max(self.MIN_STAGING_SLOTS, self.STAGING_BYTES // self.bytes_per_block)
        # Evicted blocks' copies: one row per slot, parts laid out as in a stored object.
        # Zeroed (touched) now: a first write into fresh pages costs a page fault per 4 KiB,
        # which made the engine thread's first captures ~6x slower than later ones.
        self._staging = torch.zeros(
            (self.staging_slots, self.bytes_per_block),
            dtype=torch.uint8,
            pin_memory=self.on_device,
        )
        self._staging_bytes = as_memoryview(self._staging, writable=True)
        self._offsets = [sum(self.part_bytes[:j]) for j in range(self.num_parts)]
        # Each KV tensor seen as [blocks, bytes of one block's rows], for gathers by block id.
        self._by_block = [
            t.view(torch.uint8).view(cache.num_blocks, n)
            for t, n in zip(self.tensors, self.part_bytes, strict=True)
        ]
        if not self.on_device:
            # One flat byte view per tensor, sliced per block: a store converts a memoryview
            # slice in ~0.2 us, a torch view in ~4 us (96 parts per block on a 48-layer model).
            self._bytes = [as_memoryview(t, writable=True) for t in self.tensors]
            # For the native block copy: each part's base and row stride in the KV tensors and
            # in the staging rows.
            base = self._staging.data_ptr()
            self._copy_nbytes = torch.tensor(self.part_bytes, dtype=torch.int64)
            self._copy_kv = (
                torch.tensor([t.data_ptr() for t in self.tensors], dtype=torch.int64),
                self._copy_nbytes,
            )
            self._copy_staging = (
                torch.tensor([base + off for off in self._offsets], dtype=torch.int64),
                torch.full((self.num_parts,), self.bytes_per_block, dtype=torch.int64),
            )
        else:
            self._streams = {"load": torch.cuda.Stream(), "save": torch.cuda.Stream()}
            self._pinned: dict[str, torch.Tensor] = {}

    def _rows(self, t: torch.Tensor, block_id: int) -> torch.Tensor:
        return t[block_id * self.bs : (block_id + 1) * self.bs]

    def _views(self, block_id: int) -> list[torch.Tensor]:
        return [self._rows(t, block_id) for t in self.tensors]

    def _byte_views(self, block_id: int) -> list[memoryview]:
        return [
            mv[block_id * n : (block_id + 1) * n]
            for mv, n in zip(self._bytes, self.part_bytes, strict=True)
        ]

    def _pinned_parts(self, kind: str, n: int) -> list[list[torch.Tensor]]:
        """Pinned host buffers for n blocks, reused between calls (grown when needed)."""
        need = n * self.bytes_per_block
        buf = self._pinned.get(kind)
        if buf is None or buf.numel() < need:
            buf = self._pinned[kind] = torch.empty(need, dtype=torch.uint8, pin_memory=True)
        out, offset = [], 0
        for _ in range(n):
            parts = []
            for size in self.part_bytes:
                parts.append(buf[offset : offset + size])
                offset += size
            out.append(parts)
        return out

    def _native_copy(self, to_staging: bool, block_ids: list[int], slots: list[int]) -> bool:
        """Copy between KV blocks and staging slots with one memcpy per block and part (CPU
        caches, native kernels built); False where the torch path must do it."""
        from hetserve import envs
        from hetserve.native import optional_kernel

        fn = optional_kernel("hetserve_copy_parts")
        if self.on_device or fn is None or not envs.native_kernels():
            return False
        kv = (*self._copy_kv, torch.tensor(block_ids, dtype=torch.int64))
        stg = (*self._copy_staging, torch.tensor(slots, dtype=torch.int64))
        src, dst = (kv, stg) if to_staging else (stg, kv)
        fn(
            torch.get_num_threads(), len(block_ids), self.num_parts,
            self._copy_nbytes.data_ptr(), *(t.data_ptr() for t in (*src, *dst)),
        )  # fmt: skip
        return True

    def stage(self, block_ids: list[int], slots: list[int]) -> None:
        """Copy blocks into staging slots: one gather per KV tensor. On CUDA the copy to the
        host completes before this returns (the blocks are overwritten by the next forward)."""
        if self._native_copy(True, block_ids, slots):
            return
        ids = torch.tensor(block_ids, device=self.tensors[0].device)
        rows = torch.tensor(slots)
        for tb, off, n in zip(self._by_block, self._offsets, self.part_bytes, strict=True):
            self._staging[rows, off : off + n] = tb.index_select(0, ids).cpu()

    def unstage(self, slots: list[int], block_ids: list[int]) -> None:
        """Copy staged blocks back into the KV cache (the victim cache's hit)."""
        if not slots or self._native_copy(False, block_ids, slots):
            return
        ids = torch.tensor(block_ids, device=self.tensors[0].device)
        rows = torch.tensor(slots)
        for tb, off, n in zip(self._by_block, self._offsets, self.part_bytes, strict=True):
            tb.index_copy_(0, ids, self._staging[rows, off : off + n].to(tb.device))

    def staged_parts(self, slots: list[int]) -> list[list[Any]]:
        per = self.bytes_per_block
        return [
            [
                self._staging_bytes[s * per + off : s * per + off + n]
                for off, n in zip(self._offsets, self.part_bytes, strict=True)
            ]
            for s in slots
        ]

    def load_parts(self, block_ids: Sequence[int]) -> list[list[Any]]:
        if not self.on_device:
            return [self._byte_views(b) for b in block_ids]
        return self._pinned_parts("load", len(block_ids))

    def commit_load(self, block_ids: Sequence[int], ok: int) -> None:
        if not self.on_device or ok == 0:
            return
        stream = self._streams["load"]
        staged = self._pinned_parts("load", len(block_ids))
        with torch.cuda.stream(stream):
            for b, parts in zip(block_ids[:ok], staged, strict=False):
                for dst, src in zip(self._views(b), parts, strict=True):
                    dst.view(-1).view(torch.uint8).copy_(src, non_blocking=True)
        stream.synchronize()

    def save_parts(self, block_ids: Sequence[int], buffers: str = "save") -> list[list[Any]]:
        """`buffers`: on CUDA, which pinned buffers (one set per calling thread: the saver's
        "save", the hand-off sender's "handoff")."""
        if not self.on_device:
            return [self._byte_views(b) for b in block_ids]
        stream = self._streams["save"]
        # After the kernels that wrote these blocks, whichever thread asks (streams are per
        # thread: a saver thread's current stream is not the engine's).
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        staged = self._pinned_parts(buffers, len(block_ids))
        with torch.cuda.stream(stream):
            for b, parts in zip(block_ids, staged, strict=True):
                for src, dst in zip(self._views(b), parts, strict=True):
                    dst.copy_(src.reshape(-1).view(torch.uint8), non_blocking=True)
        stream.synchronize()
        return staged

    def write_blocks(self, block_ids: Sequence[int], data: memoryview) -> None:
        """Fill blocks from their bytes back to back, page-first (a hand-off landing): one
        strided copy per KV tensor."""
        if not block_ids:
            return
        src = torch.frombuffer(data, dtype=torch.uint8).view(len(block_ids), self.bytes_per_block)
        ids = torch.tensor(list(block_ids), device=self.tensors[0].device)
        for tb, off, n in zip(self._by_block, self._offsets, self.part_bytes, strict=True):
            tb.index_copy_(0, ids, src[:, off : off + n].to(tb.device))


def open_tiers(
    spec: str,
    save: KVSave,
    load: KVLoad,
    kv: KVCacheManager,
    io: BlockIO,
    cost: CostModel,
    state_io: StateIO | None = None,
) -> tuple[TierManager, str]:
    """Open and check the store `spec`, add its tiers' probed costs to the engine's `cost`
    model (whose prefill rate the engine measured), and attach the tiers to `kv` (the
    scheduler is given them as its loader). Returns them and a summary line."""
    from hetserve.store.selfcheck import open_and_check

    namespace = "hetserve-probe-" + kv.hash_seed.hex()[:16]
    store, probe = open_and_check(spec, namespace, io.bytes_per_block, parts=io.num_parts)
    cost.tiers.update({n: TierCost(p.latency_s, p.bandwidth) for n, p in probe.tiers.items()})
    cost.copy_bandwidth = probe.copy_bandwidth
    infos = store.tiers()
    shared = any(t.shared for t in infos)
    write_through = save is KVSave.WRITE_THROUGH or (save is KVSave.AUTO and shared)
    tiers = TierManager(
        store,
        cost,
        kv,
        io,
        write_through=write_through,
        always_load=load is KVLoad.ALWAYS,
        sync_lookup=not shared,
        state_io=state_io,
    )
    return tiers, _summary(kv, io, probe, infos, cost, write_through)


def _summary(kv, io, probe, infos, cost: CostModel, write_through: bool) -> str:
    """One line: each tier with what its probe measured (the fit, each read size's median,
    any doubt), the copy rate that bounds them, the prefill rate they are weighed against."""
    tiers = []
    for t in infos:
        text = f"{t.name} {_size(t.capacity)}"
        measured = probe.describe(t.name)
        tiers.append(text + (f" ({measured})" if measured else " (not probed)"))
    device = kv.pool.num_usable
    mode = "write-through + write-back" if write_through else "write-back"
    copy = f"copy {probe.copy_bandwidth / 1e9:.1f} GB/s; " if probe.copy_bandwidth else ""
    return (
        f"KV tiers: device {device} blocks ({_size(device * io.bytes_per_block)}) -> "
        f"{', '.join(tiers)} [{probe.store}; saves {mode}; {copy}prefill "
        f"{cost.prefill_tokens_per_s or 0:.0f} tok/s]"
    )


def _size(n: int | None) -> str:
    if n is None:
        return "unbounded"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
