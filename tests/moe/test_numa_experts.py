"""`--numa auto` applied (moe/numa_experts.py) on a fake two-node topology: node 0 -> CPU 0,
node 1 -> CPU 1 of this machine (which has one real node, so binding to node 1 must fail
cleanly and binding to node 0 must take)."""

import errno
import logging

import pytest
import torch

from hetserve.errors import InvalidInputError
from hetserve.moe.experts import ExpertWeights, create_backend
from hetserve.moe.numa_experts import NumaExperts, NumaSplit, bind_tensors
from hetserve.native import kernel, native_unavailable_reason

pytestmark = pytest.mark.skipif(
    native_unavailable_reason() is not None, reason=f"native kernels: {native_unavailable_reason()}"
)
E, H, INTER, K = 8, 64, 96, 3


def fake_two_nodes(root):
    for node in (0, 1):
        d = root / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(f"{node}\n")
    return root


def weights(seed: int = 0, bias: bool = False) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.1
    w2 = torch.randn(E, H, INTER, generator=g) * 0.1
    b13 = torch.randn(E, 2 * INTER, generator=g) * 0.1 if bias else None
    b2 = torch.randn(E, H, generator=g) * 0.1 if bias else None
    return ExpertWeights(w13, w2, b13, b2)


def routing(t: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    tw = torch.softmax(torch.randn(t, K, generator=g), -1)
    return x, tw, ids


@pytest.fixture
def split(tmp_path):
    s = NumaSplit("auto", fake_two_nodes(tmp_path))
    yield s
    s.close()


def split_layer(split: NumaSplit, name: str, w: ExpertWeights):
    return split.wrap(lambda part: create_backend(name, part), w)


def test_plan_applied_and_teams_pinned(split, caplog):
    with caplog.at_level(logging.INFO, logger="hetserve.moe.numa_experts"):
        layer = split_layer(split, "cpu-int8", weights())
    assert isinstance(layer, NumaExperts)
    # each shard holds the experts the plan says: 4 and 4, numbered from its start
    assert [(s.node, s.start, s.stop, s.cpus) for s, _, _ in layer.shards] == [
        (0, 0, 4, (0,)),
        (1, 4, 8, (1,)),
    ]
    assert [b.num_experts for _, b, _ in layer.shards] == [4, 4]
    # every thread of each team, read back with sched_getaffinity inside it, runs on its node's CPU
    assert split.teams[0].masks == [0b01] and split.teams[1].masks == [0b10]
    assert split.teams[0].error == split.teams[1].error == 0
    for node, team in split.teams.items():  # and as /proc shows the team's Python thread
        status = open(f"/proc/self/task/{team.tid}/status").read()
        assert f"Cpus_allowed_list:\t{node}\n" in status
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("numa:")]
    assert line.startswith("numa: 2 nodes (node 0: 4 experts, 1 CPUs, node 1: 4 experts, 1 CPUs)")
    # node 1 does not exist on this one-node machine: a stated fallback, not a crash
    assert f"node 1 failed with errno {errno.EINVAL} (EINVAL)" in line
    assert split.bind_errors == {1: errno.EINVAL}


@pytest.mark.parametrize("name", ["cpu-int8", "cpu-fp32", "cpu-int4", "cpu-mxfp4", "cpu-fp8"])
@pytest.mark.parametrize("t", [1, 7])
def test_split_equals_unsplit_bit_exact(split, name, t):
    w = weights(bias=name == "cpu-mxfp4")
    whole, layer = create_backend(name, w), split_layer(split, name, w)
    assert isinstance(layer, NumaExperts)
    x, tw, ids = routing(t)
    assert torch.equal(layer.forward(x, tw, ids), whole.forward(x, tw, ids))
    # tokens whose experts all live on one node (the other shard has no pairs)
    ids = torch.tensor([[0, 1, 2]] * t)
    assert torch.equal(layer.forward(x, tw, ids), whole.forward(x, tw, ids))


def test_bad_expert_id_raises_and_leaves_no_shard_waiting(split):
    layer = split_layer(split, "cpu-int8", weights())
    x, tw, ids = routing(2)
    ids[1, 0] = E
    with pytest.raises(InvalidInputError, match="topk_ids outside"):
        layer.forward(x, tw, ids)
    x, tw, ids = routing(2)  # the teams still answer
    assert layer.forward(x, tw, ids).shape == (2, H)


def test_bind_to_node0_takes_and_to_a_missing_node_fails_cleanly():
    t = torch.empty(1 << 20)  # 4 MiB
    assert bind_tensors([t], 0) == 0
    t.fill_(1.0)
    assert kernel("hetserve_page_node")(t[4096:].data_ptr()) == 0  # get_mempolicy: on node 0
    assert bind_tensors([t], 1) == errno.EINVAL  # no node 1 here: reported, t unchanged
    assert float(t.sum()) == t.numel()


def test_one_node_or_off_is_todays_backend(tmp_path):
    one = tmp_path / "one"
    (one / "node0").mkdir(parents=True)
    (one / "node0" / "cpulist").write_text("0-1\n")
    for s in (NumaSplit("auto", one), NumaSplit("off", fake_two_nodes(tmp_path / "two"))):
        layer = split_layer(s, "cpu-int8", weights())
        assert not isinstance(layer, NumaExperts) and not s.teams
    assert NumaSplit("auto", one).describe(None) == "numa: experts not split (1 NUMA node)"
    with pytest.raises(InvalidInputError, match="numa must be one of"):
        NumaSplit("on")


def test_start_up_line_is_printed_where_numa_auto_was_asked_for(tmp_path, capsys):
    # The README's start-up line: printed (as the placement and memory lines are) when the user
    # asked for --numa auto, whether or not it split; not under the default off.
    one = tmp_path / "one"
    (one / "node0").mkdir(parents=True)
    (one / "node0" / "cpulist").write_text("0-1\n")
    for mode in ("off", "auto"):
        s = NumaSplit(mode, one)
        split_layer(s, "cpu-int8", weights())
        split_layer(s, "cpu-int8", weights(1))  # once, not per layer
    assert capsys.readouterr().err == "numa: experts not split (1 NUMA node)\n"


def test_engine_numa_auto_generates_what_off_does(tiny_model, tmp_path, monkeypatch, caplog):
    from hetserve import LLM, SamplingParams
    from hetserve.moe.hybrid import DeviceBridge

    monkeypatch.setenv("HETSERVE_NUMA_SYSFS", str(fake_two_nodes(tmp_path)))
    path = tiny_model("qwen3-moe", overrides={"moe_intermediate_size": 64})
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
    prompts = [[11, 12, 13, 14], list(range(20, 45))]
    outs = {}
    for mode in ("off", "auto"):
        with caplog.at_level(logging.INFO, logger="hetserve.moe.numa_experts"):
            llm = LLM(path, placement="all-int8", numa=mode)
        got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        outs[mode] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got]
        backends = [e._phase_backends["decode"] for _, e in llm.model.routed_experts()]
        inner = [b.inner if isinstance(b, DeviceBridge) else b for b in backends]
        assert all(isinstance(b, NumaExperts) for b in inner) == (mode == "auto")
    assert outs["auto"] == outs["off"]  # bit-exact: the same tokens and logprobs
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("numa:")]
    assert lines[0] == "numa: experts not split (--numa off)"
    assert lines[1].startswith("numa: 2 nodes (node 0: ")


def test_team_pin_reaches_every_openmp_thread_of_the_team():
    # A team larger than its CPUs (2 threads on CPU 1): every thread, the OpenMP one included,
    # reads back CPU 1 alone. Run on a thread of its own so the test's thread stays unpinned.
    import ctypes
    from concurrent.futures import ThreadPoolExecutor

    masks = (ctypes.c_uint64 * 2)()
    with ThreadPoolExecutor(1) as pool:
        rc = pool.submit(kernel("hetserve_team_pin"), 2, (ctypes.c_int * 1)(1), 1, masks).result()
    assert rc == 0 and list(masks) == [0b10, 0b10]


def test_mapped_kernel_layout_experts_are_not_split(split):
    import dataclasses

    mapped = dataclasses.replace(weights(), layout=object())  # a stand-in: only its presence
    assert split.wrap(lambda w: "today's backend", mapped) == "today's backend"
    assert not split.teams
