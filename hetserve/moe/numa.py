"""NUMA placement of routed experts: which node holds which experts of a layer, and which CPUs
(one thread team per node) run them.

Who calls it: `moe/numa_experts.py` (`NumaSplit`, built by `model/hybrid_plan.py` for
`--numa auto`), which applies the plan: each shard's weights bound to its node, a thread team
pinned to its CPUs. This module is the policy half: `read_topology` reads Linux's sysfs (or a
fake tree: HETSERVE_NUMA_SYSFS, tests), `plan_layer` is pure. Failures:
`InvalidInputError` for an unknown mode or a node that cannot hold its share of the experts;
a machine without the sysfs tree reads as one node with every CPU (nothing to split).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from hetserve.errors import InvalidInputError

SYSFS_NODES = Path("/sys/devices/system/node")
NUMA_MODES = ("off", "auto")


@dataclass(frozen=True)
class NumaNode:
    node: int
    cpus: tuple[int, ...]
    mem_bytes: int | None  # None: the kernel did not say


@dataclass(frozen=True)
class ExpertShard:
    """Experts [start, stop) of a layer, their memory on `node`, run by the team `cpus`."""

    node: int | None  # None: no binding (mode off, or a one-node machine)
    start: int
    stop: int
    cpus: tuple[int, ...]


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Linux's cpulist format, e.g. "0-3,8,10-11" -> (0, 1, 2, 3, 8, 10, 11)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return tuple(cpus)


def read_topology(root: Path = SYSFS_NODES) -> tuple[NumaNode, ...]:
    """The NUMA nodes that have CPUs, in node order; one node with every CPU where `root` is
    absent (containers without sysfs, other systems)."""
    nodes = []
    dirs = sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])) if root.is_dir() else []
    for d in dirs:
        try:
            cpus = parse_cpulist((d / "cpulist").read_text())
        except OSError:
            continue
        if cpus:  # memory-only nodes (CXL, HBM) run no team
            nodes.append(NumaNode(int(d.name[4:]), cpus, _mem_total(d / "meminfo")))
    if not nodes:
        nodes = [NumaNode(0, tuple(range(os.cpu_count() or 1)), None)]
    return tuple(nodes)


def _mem_total(path: Path) -> int | None:
    try:
        match = re.search(r"MemTotal:\s+(\d+)\s*kB", path.read_text())
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def plan_layer(
    nodes: tuple[NumaNode, ...], num_experts: int, expert_bytes: int, mode: str = "auto"
) -> list[ExpertShard]:
    """Split a layer's experts into contiguous shards, one per node, in proportion to the
    node's CPUs (a team's speed), so each team reads only its own node's memory. `off`, or a
    single node, is one unbound shard on every CPU. Every layer splits the same way, so
    `expert_bytes` is one expert index's bytes summed over the layers (checked against each
    node's memory)."""
    if mode not in NUMA_MODES:
        raise InvalidInputError(f"numa must be one of {', '.join(NUMA_MODES)}, got {mode!r}")
    if num_experts < 1 or not nodes:
        raise InvalidInputError("plan_layer needs at least one expert and one node")
    if mode == "off" or len(nodes) == 1:
        every = tuple(sorted(c for n in nodes for c in n.cpus))
        return [ExpertShard(None, 0, num_experts, every)]
    used = nodes[:num_experts]  # more nodes than experts: the extra nodes hold none
    total_cpus = sum(len(n.cpus) for n in used)
    shards, start = [], 0
    for i, n in enumerate(used):
        # Rounded cumulative shares: sizes differ by at most one from the exact proportion,
        # every node gets at least one expert, and the last ends at num_experts.
        left = len(used) - i - 1
        share = round(num_experts * sum(len(m.cpus) for m in used[: i + 1]) / total_cpus)
        stop = num_experts if left == 0 else min(max(share, start + 1), num_experts - left)
        if n.mem_bytes is not None and (stop - start) * expert_bytes > n.mem_bytes:
            raise InvalidInputError(
                f"NUMA node {n.node} cannot hold its {stop - start} experts "
                f"({(stop - start) * expert_bytes / 2**30:.1f} GiB > "
                f"{n.mem_bytes / 2**30:.1f} GiB); use --numa off"
            )
        shards.append(ExpertShard(n.node, start, stop, n.cpus))
        start = stop
    return shards
