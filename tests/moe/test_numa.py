"""NUMA expert placement policy on a fake sysfs topology (this machine has one node)."""

import pytest

from hetserve.errors import InvalidInputError
from hetserve.moe.numa import ExpertShard, parse_cpulist, plan_layer, read_topology

GIB = 2**30


def fake_sysfs(root, nodes: dict[int, tuple[str, int | None]]):
    for node, (cpulist, mem_kb) in nodes.items():
        d = root / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
        if mem_kb is not None:
            (d / "meminfo").write_text(
                f"Node {node} MemTotal:       {mem_kb} kB\nNode {node} MemFree:  1 kB\n"
            )
    (root / "possible").write_text("0-1\n")  # sysfs has such files beside the node dirs
    return root


def test_cpulist_format():
    assert parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpulist("") == ()


def test_two_nodes_split_experts_with_their_cpus(tmp_path):
    root = fake_sysfs(tmp_path, {0: ("0-7", 64 * 2**20), 1: ("8-15", 64 * 2**20)})
    nodes = read_topology(root)
    assert [(n.node, len(n.cpus), n.mem_bytes) for n in nodes] == [
        (0, 8, 64 * GIB),
        (1, 8, 64 * GIB),
    ]
    shards = plan_layer(nodes, 64, expert_bytes=100 * 2**20)
    assert shards == [
        ExpertShard(0, 0, 32, tuple(range(8))),
        ExpertShard(1, 32, 64, tuple(range(8, 16))),
    ]
    assert plan_layer(nodes, 64, 1, mode="off") == [ExpertShard(None, 0, 64, tuple(range(16)))]


def test_uneven_nodes_and_odd_counts_cover_every_expert_once(tmp_path):
    root = fake_sysfs(tmp_path, {0: ("0-3", None), 1: ("4-15", None), 2: ("", 10**6)})
    nodes = read_topology(root)
    assert [n.node for n in nodes] == [0, 1]  # node 2 has memory but no CPUs: no team
    shards = plan_layer(nodes, 64, 1)
    assert [(s.start, s.stop) for s in shards] == [(0, 16), (16, 64)]
    for n in (1, 2, 3, 7):
        spans = [(s.start, s.stop) for s in plan_layer(nodes, n, 1)]
        covered = [e for a, b in spans for e in range(a, b)]
        assert covered == list(range(n)) and all(b > a for a, b in spans)


def test_a_node_too_small_for_its_share_is_refused(tmp_path):
    root = fake_sysfs(tmp_path, {0: ("0-1", 2**20), 1: ("2-3", 2**20)})  # 1 GiB each
    with pytest.raises(InvalidInputError, match="node 0 cannot hold its 32 experts"):
        plan_layer(read_topology(root), 64, expert_bytes=64 * 2**20)
    with pytest.raises(InvalidInputError, match="numa must be one of"):
        plan_layer(read_topology(root), 64, 1, mode="interleave")


def test_no_sysfs_is_one_unbound_node(tmp_path):
    nodes = read_topology(tmp_path / "absent")
    assert len(nodes) == 1 and nodes[0].mem_bytes is None
    assert plan_layer(nodes, 8, 1) == [ExpertShard(None, 0, 8, nodes[0].cpus)]
