"""Decode graphs: buckets, the padded static-buffer forward against the unpadded eager one, the
split capture's order around host calls, and (where CUDA exists) graphs against eager."""

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.engine.decode_graphs import (
    DecodeGraphs,
    SplitGraph,
    bucket_sizes,
    pick_bucket,
    pick_width,
)
from hetserve.engine.runner import GraphOptions, ModelRunner, SeqInput

BS = 4  # small blocks: the sequences below span several, padded tables differ in width


def test_buckets_cover_every_batch_size_once():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(64)[-3:] == [48, 56, 64]
    assert [pick_bucket(bucket_sizes(20), n) for n in (1, 3, 5, 9, 17, 20, 21)] == [
        1, 4, 8, 16, 20, 20, None,
    ]  # fmt: skip


def test_table_width_is_the_longest_context_rounded_up_to_a_power_of_two():
    assert [pick_width(64, n) for n in (0, 1, 16, 17, 33, 64, 65)] == [
        16, 16, 16, 32, 64, 64, None,
    ]  # fmt: skip
    assert pick_width(8, 3) == 8 and pick_width(48, 40) == 48  # never past max_blocks


def test_short_and_long_contexts_get_their_own_widths(tiny_model):
    """A graph's attention spans its table's width: a short context must not be padded to the
    model's length (batch-8 graphs ran at 0.82x eager so on an H200), nor a long one cut."""
    path = tiny_model("deepseek-v3", lm_head_scale=8.0)
    prompts = [list(range(10, 20)), [5 + i % 90 for i in range(300)]]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    want = LLM(path, placement="device").generate(prompt_token_ids=prompts, sampling_params=params)
    llm = LLM(path, placement="device")
    r = llm.engine.runner
    r.graphs = DecodeGraphs(r.model, r.kv, r.block_size, 8, 64, capture=False)
    short = llm.generate(prompt_token_ids=prompts[:1], sampling_params=params)
    both = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    widths = sorted(inputs.tables.shape[1] for inputs in r.graphs._inputs.values())
    assert r.block_size == 16 and widths == [16, 32]  # 300 tokens: 19 blocks
    assert [o.token_ids for o in both] == [o.token_ids for o in want]
    assert short[0].token_ids == want[0].token_ids


def _runner(model, graphs: GraphOptions | None) -> ModelRunner:
    return ModelRunner(model, num_blocks=40, block_size=BS, graphs=graphs)


def _prefill_then_decode(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(len(prompts))]
    runner.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    steps = [
        SeqInput([7 + i], len(p), t) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
    ]
    return runner.forward(steps)


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3", "gpt-oss"])
def test_padded_bucket_equals_unpadded_eager(tiny_model, family):
    llm = LLM(tiny_model(family))
    model = llm.model
    prompts = [list(range(10, 15)), list(range(20, 33)), list(range(40, 49))]  # 3 -> bucket 4
    eager = _runner(model, None)
    padded = _runner(model, GraphOptions(max_batch=8, max_blocks=8, capture=False))
    want = _prefill_then_decode(eager, prompts)
    got = _prefill_then_decode(padded, prompts)
    assert padded.graphs is not None and padded.graphs.forwards == 1
    assert got.shape == want.shape == (3, model.config.hidden_size)
    # Same arithmetic on more rows: equal up to the GEMM's batch-size-dependent blocking.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Padding rows wrote only the null block: every real block holds the same K/V.
    for la, lb in zip(eager.kv.layers, padded.kv.layers, strict=True):
        for a, b in zip(la, lb, strict=True):
            torch.testing.assert_close(a[BS:], b[BS:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3-moe", "deepseek-v3.2", "minimax-m2"])
def test_static_buffers_decode_many_steps_like_eager(tiny_model, family):
    """Every step refills the same buffers in place, so nothing may be computed once per
    tensor and kept (rotary angles were, by the positions tensor's identity: decode through
    CUDA graphs left eager's greedy tokens at the second step on an H200)."""
    path = tiny_model(family, lm_head_scale=8.0)
    prompts = [list(range(10 + i, 40 + 5 * i)) for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = LLM(path, placement="device").generate(prompt_token_ids=prompts, sampling_params=params)
    llm = LLM(path, placement="device")
    r = llm.engine.runner
    r.graphs = DecodeGraphs(r.model, r.kv, r.block_size, 8, 16, capture=False)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert r.graphs.forwards >= 7
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_batches_it_cannot_take_run_eagerly(tiny_model):
    model = LLM(tiny_model("qwen3-moe", overrides={"num_experts_per_tok": 4})).model
    runner = _runner(model, GraphOptions(max_batch=2, max_blocks=8, capture=False))
    prompts = [[11, 12], [13, 14], [15, 16]]
    _prefill_then_decode(runner, prompts)  # three sequences: past the largest bucket
    assert runner.graphs.forwards == 0
    _prefill_then_decode(runner, prompts[:2])
    assert runner.graphs.forwards == 1
    model.set_expert_deferral(1)  # deferral's futures cannot be replayed
    _prefill_then_decode(runner, prompts[:2])
    assert runner.graphs.forwards == 1


class FakeGraph:
    def __init__(self, log: list[str]) -> None:
        self.log, self.name = log, f"g{sum(e.startswith('begin') for e in log)}"

    def capture_begin(self, pool=None) -> None:
        self.log.append(f"begin {self.name}")

    def capture_end(self) -> None:
        self.log.append(f"end {self.name}")

    def replay(self) -> None:
        self.log.append(f"replay {self.name}")


def test_split_capture_replays_graphs_and_host_calls_in_order():
    log: list[str] = []
    split = SplitGraph(lambda: FakeGraph(log))
    x = torch.ones(2, 3)
    split.begin()
    outs = []
    for k in range(2):  # two host-expert layers

        def host(a, k=k):
            log.append(f"host {k}")
            return a * (k + 2)

        outs.append(split.host_call(host, x, x))
    split.end()
    assert log == ["begin g0", "end g0", "begin g1", "end g1", "begin g2", "end g2"]
    log.clear()
    split.replay()
    assert log == ["replay g0", "host 0", "replay g1", "host 1", "replay g2"]
    assert torch.equal(outs[0], x * 2) and torch.equal(outs[1], x * 3)


def test_enforce_eager_and_cpu_build_no_graphs(tiny_model):
    path = tiny_model("qwen3-moe")
    assert LLM(path).engine.runner.graphs is None  # CPU: the eager path is the same arithmetic
    assert LLM(path, enforce_eager=True).engine.config.enforce_eager


@pytest.mark.gpu
@pytest.mark.parametrize(
    "family,placement",
    [("qwen3-moe", "device"), ("qwen3-moe", "hybrid"), ("deepseek-v3", "hybrid")],
)
def test_cuda_graphs_match_eager(tiny_model, family, placement):
    """hybrid: routed experts on the host split every graph (one host call per MoE layer);
    deepseek-v3's shared experts overlap them from another thread. In fp32: in bf16 the padded
    bucket's other GEMM shapes alone flip greedy tokens of these scaled-logit models."""
    path = tiny_model(family, lm_head_scale=8.0)
    ids = [list(range(10 + i, 30 + 3 * i)) for i in range(5)]  # 5 sequences: bucket 8
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(path, device="cuda", dtype="float32", placement=placement, enforce_eager=eager)
        outs[eager] = llm.generate(prompt_token_ids=ids, sampling_params=params)
        graphs = llm.engine.runner.graphs
        assert (graphs is None) if eager else (graphs.forwards > 0 and graphs._graphs)
        llm.close()
    for e, g in zip(outs[True], outs[False], strict=True):
        assert e.token_ids == g.token_ids
        le = torch.tensor([d[t].logprob for d, t in zip(e.logprobs, e.token_ids, strict=True)])
        lg = torch.tensor([d[t].logprob for d, t in zip(g.logprobs, g.token_ids, strict=True)])
        torch.testing.assert_close(lg, le, rtol=0, atol=1e-3)
