"""`--numa auto`: a layer's routed experts split across NUMA nodes, each shard's weights bound
to its node and run by a thread team pinned to that node's CPUs.

Who calls it: `model/hybrid_plan.py`'s `ExpertsBuilder` (`NumaSplit.wrap`) for every CPU
experts backend with a native kernel (cpu-fp32, cpu-int8, cpu-int4, cpu-mxfp4, cpu-fp8). The
policy (which node holds which experts, which CPUs run them) is `moe/numa.py`'s `plan_layer`;
this module applies it: one native backend per shard built from that shard's experts alone,
its weight tensors bound to the node with mbind(2) (moving pages already touched), and one
team per node: a Python worker thread pinned with pthread_setaffinity_np, whose OpenMP threads
(the kernel's parallel loop) are pinned with it (native/numa.c). A forward hands every shard
the whole batch at once; each shard skips the pairs routed elsewhere, and their sums meet in
one output in shard order (native/moe_kernels.c, hs_shard_t), so the result is bit-exact with
the unsplit backend's.

Failures: one node, `--numa off`, a backend without the native kernel, or experts mapped from
a kernel-layout checkpoint (`hetserve convert`: shared page cache): the backend is returned as
it is (today's behaviour). A node the kernel refuses to bind (EINVAL: no such node;
EPERM/ENOSYS: a container without the NUMA calls) leaves that shard's memory where it was
allocated, with its team still pinned; the start-up log line says so with the errno.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from hetserve import envs
from hetserve.errors import InvalidInputError
from hetserve.moe.experts import ExpertsBackend, ExpertWeights
from hetserve.moe.numa import SYSFS_NODES, ExpertShard, NumaNode, plan_layer, read_topology
from hetserve.native import kernel

log = logging.getLogger(__name__)
_I64, _F32 = torch.int64, torch.float32


class Team:
    """One native thread pinned (with its OpenMP team of len(cpus) threads) to `cpus`, which
    runs the shard calls `NumaExperts` posts to it (native/numa.c, hs_team_t)."""

    def __init__(self, node: int | None, cpus: tuple[int, ...]) -> None:
        self.node, self.cpus = node, cpus
        n = len(cpus)
        err, tid, masks = ctypes.c_int(0), ctypes.c_int(0), (ctypes.c_uint64 * n)()
        handle = kernel("hetserve_team_new")(
            (ctypes.c_int * n)(*cpus), n, n, ctypes.byref(err), masks, ctypes.byref(tid)
        )
        if not handle:
            raise MemoryError(f"could not start the NUMA team of node {node}")
        self.handle = handle
        self.error = err.value  # errno of the pinning, 0 when it took
        self.masks = list(masks)  # each team thread's CPU mask as the kernel reported it
        self.tid = tid.value  # the team thread's kernel id (/proc/self/task/TID)
        self._free = weakref.finalize(self, kernel("hetserve_team_free"), handle)

    def close(self) -> None:
        self._free()


def bind_tensors(tensors: list[torch.Tensor | None], node: int) -> int:
    """Binds each tensor's whole pages to `node` (moving them there); 0 or the first errno."""
    mbind = kernel("hetserve_mbind")
    for t in tensors:
        if t is not None and t.nbytes:
            rc = mbind(t.data_ptr(), t.nbytes, node)
            if rc:
                return int(rc)
    return 0


def shard_weights(weights: ExpertWeights, start: int, stop: int) -> ExpertWeights:
    """Experts [start, stop) of a layer: views of dense weights, the packed matrices' slices."""

    def part(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[start:stop]

    p = weights.packed
    if p is not None:
        p = dataclasses.replace(p, w13=p.w13[start:stop], w2=p.w2[start:stop])
    w13, w2, b13, b2 = (part(t) for t in (weights.w13, weights.w2, weights.b13, weights.b2))
    return ExpertWeights(w13, w2, b13, b2, p)


class NumaExperts:
    """ExpertsBackend over one native backend per shard (`cpu_native._NativeExperts`)."""

    def __init__(self, shards: list[tuple[ExpertShard, object, Team]], num_experts: int) -> None:
        self.shards, self.num_experts = shards, num_experts
        self.hidden = shards[0][1].hidden
        for s, b, _ in shards:
            kernel("hetserve_moe_shard")(b._h, s.start, num_experts)
        n = len(shards)
        # the teams and shard handles as C arrays, made once (one ctypes call per layer)
        self._teams = (ctypes.c_void_p * n)(*(team.handle for _, _, team in shards))
        self._handles = (ctypes.c_void_p * n)(*(b._h for _, b, _ in shards))
        self._run = kernel("hetserve_moe_run_teams")

    def nbytes(self) -> int:
        return sum(b.nbytes() for _, b, _ in self.shards)

    def expert_nbytes(self) -> int:
        return self.shards[0][1].expert_nbytes()

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if not (x.is_cpu and x.dtype is _F32 and x.is_contiguous()):
            return self.forward(x.to("cpu", _F32).contiguous(), topk_weights, topk_ids).to(
                x.device, x.dtype
            )
        ids = topk_ids.to("cpu", _I64).contiguous()
        tw = topk_weights.to("cpu", _F32).contiguous()
        if ids.dim() != 2 or tw.shape != ids.shape or x.shape != (ids.shape[0], self.hidden):
            raise InvalidInputError(
                f"numa experts need x [t, {self.hidden}] and topk weights and ids of one shape "
                f"[t, k]; got x {tuple(x.shape)}, ids {tuple(ids.shape)}"
            )
        t, k = ids.shape
        out = torch.empty_like(x)
        rc = self._run(
            self._teams, self._handles, len(self.shards), t, k, ids.data_ptr(), tw.data_ptr(),
            x.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        if rc == -2:
            raise InvalidInputError(f"topk_ids outside [0, {self.num_experts})")
        if rc:
            raise MemoryError("native MoE kernel could not allocate its activation buffers")
        return out

    def close(self) -> None:
        for _, b, _ in self.shards:
            getattr(b, "close", lambda: None)()


class NumaSplit:
    """The start-up half of `--numa`: the topology read once, one team per node shared by every
    layer, and one log line. `wrap` is called with each layer's backend name and weights."""

    def __init__(self, mode: str, root: os.PathLike[str] | None = None) -> None:
        if mode not in ("off", "auto"):
            raise InvalidInputError(f"numa must be one of off, auto, got {mode!r}")
        self.mode = mode
        self.nodes: tuple[NumaNode, ...] = read_topology(
            Path(root or envs.numa_sysfs() or SYSFS_NODES)
        )
        self.teams: dict[int | None, Team] = {}
        self.bind_errors: dict[int, int] = {}
        self._lock = threading.Lock()
        self.plan: list[ExpertShard] | None = None
        self._logged = False

    @property
    def active(self) -> bool:
        return self.mode == "auto" and len(self.nodes) > 1

    def wrap(
        self, make: Callable[[ExpertWeights], ExpertsBackend], weights: ExpertWeights
    ) -> ExpertsBackend:
        """`make(weights)` (today's backend) unless the split applies: then one `make` per
        shard, bound and pinned, behind a NumaExperts."""
        if not self.active:
            self._log_once(None)
            return make(weights)
        if getattr(weights, "layout", None) is not None:
            # A mapped `hetserve convert` file is shared, read-only page cache: not split (its
            # pages are other processes' too, and binding them would move theirs).
            self._log_once(None, why="experts mapped from a kernel-layout checkpoint")
            return make(weights)
        plan = plan_layer(self.nodes, weights.num_experts, 0, "auto")
        shards = []
        for s in plan:
            backend = make(shard_weights(weights, s.start, s.stop))
            if not hasattr(backend, "_h"):  # no native kernel (library fallback): no split
                self._log_once(None, why="the experts backend has no native kernel")
                return make(weights)
            rc = bind_tensors(list(backend._tensors) + [backend.b13, backend.b2], s.node)
            if rc:
                self.bind_errors.setdefault(s.node, rc)
            shards.append((s, backend, self._team(s)))
        self.plan = plan
        self._log_once(plan)
        return NumaExperts(shards, weights.num_experts)

    def _team(self, s: ExpertShard) -> Team:
        with self._lock:
            if s.node not in self.teams:
                self.teams[s.node] = Team(s.node, s.cpus)
            return self.teams[s.node]

    def _log_once(self, plan: list[ExpertShard] | None, why: str | None = None) -> None:
        if self._logged:
            return
        self._logged = True
        line = self.describe(plan, why)
        log.info("%s", line)
        if self.mode == "auto":  # asked for: said at start-up, as the placement line is
            print(line, file=sys.stderr, flush=True)

    def describe(self, plan: list[ExpertShard] | None, why: str | None = None) -> str:
        """The start-up line: what the split did, or why there is none."""
        if plan is None:
            if why is None:
                why = "--numa off" if self.mode == "off" else f"{len(self.nodes)} NUMA node"
            return f"numa: experts not split ({why})"
        per_node = ", ".join(
            f"node {s.node}: {s.stop - s.start} experts, {len(s.cpus)} CPUs" for s in plan
        )
        line = f"numa: {len(plan)} nodes ({per_node})"
        for node, rc in sorted(self.bind_errors.items()):
            line += (
                f"; binding memory to node {node} failed with errno {rc} "
                f"({errno.errorcode.get(rc, '?')}): its experts stay where allocated"
            )
        return line

    def close(self) -> None:
        for team in self.teams.values():
            team.close()
