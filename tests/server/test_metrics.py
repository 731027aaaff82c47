"""`/metrics` of the KV tiers: each tier's loads as predicted and as measured."""

from __future__ import annotations

from types import SimpleNamespace

from hetserve.core.stats import EngineStats, LoadFit, TierStats
from hetserve.server.metrics import ServerMetrics


class _Engine:
    config = SimpleNamespace(cache=SimpleNamespace(block_size=16))

    def __init__(self, stats: EngineStats) -> None:
        self.observers: list = []
        self._stats = stats

    def stats(self) -> EngineStats:
        return self._stats


def test_load_time_predicted_and_measured_per_tier():
    fits = {
        "ssd": LoadFit(2, predicted_s=0.25, measured_s=0.5, predicted_wait_s=0.5,
                       measured_wait_s=0.625),
        "dram": LoadFit(3, 0.125, 0.125, 0.125, 0.125),
    }  # fmt: skip
    text = ServerMetrics(_Engine(EngineStats(tiers=TierStats(load_fit=fits)))).render().decode()
    lines = set(text.splitlines())
    for line in (
        'hetserve_kv_load_seconds_count{tier="ssd"} 2.0',
        'hetserve_kv_load_seconds_sum{tier="ssd"} 0.5',
        'hetserve_kv_load_predicted_seconds_sum{tier="ssd"} 0.25',
        'hetserve_kv_load_wait_seconds_sum{tier="ssd"} 0.625',
        'hetserve_kv_load_wait_predicted_seconds_count{tier="dram"} 3.0',
        'hetserve_kv_load_fit_ratio{part="read",tier="ssd"} 2.0',
        'hetserve_kv_load_fit_ratio{part="wait",tier="ssd"} 1.25',
        'hetserve_kv_load_fit_ratio{part="read",tier="dram"} 1.0',
    ):
        assert line in lines, line


def test_no_loads_yet_is_no_ratio():
    text = ServerMetrics(_Engine(EngineStats(tiers=TierStats()))).render().decode()
    assert "# TYPE hetserve_kv_load_seconds summary" in text
    assert "hetserve_kv_load_fit_ratio{" not in text


def test_step_time_by_kind_and_chunk_sizes(tiny_model):
    """A real engine runs a stream beside a chunked prompt: /metrics shows its steps by kind."""
    from hetserve import LLM, SamplingParams

    llm = LLM(tiny_model("llama"), max_num_batched_tokens=32, max_step_ms=float("inf"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(prompt_token_ids=[[5, 6, 7, 8], list(range(1, 101))], sampling_params=params)
    stats = llm.engine.stats()
    text = ServerMetrics(_Engine(stats)).render().decode()
    lines = set(text.splitlines())
    kinds = stats.step_kinds
    # Step 1: 4 + 28 prompt tokens; steps 2-3: a decode beside chunks of 31 and 31; step 4: a
    # decode beside the last 10; then decodes only.
    assert 'hetserve_prefill_chunk_tokens_count{kind="prefill"} 2.0' in lines
    assert 'hetserve_prefill_chunk_tokens_count{kind="mixed"} 3.0' in lines
    assert 'hetserve_prefill_chunk_tokens_bucket{kind="mixed",le="16.0"} 1.0' in lines
    assert 'hetserve_prefill_chunk_tokens_bucket{kind="mixed",le="32.0"} 3.0' in lines
    assert 'hetserve_prefill_chunk_tokens_sum{kind="mixed"} 72.0' in lines
    assert (
        f'hetserve_step_seconds_count{{kind="decode"}} {kinds["decode"].seconds.count}.0' in lines
    )
    assert kinds["decode"].seconds.count == 7  # the stream's other tokens; the long one's
    assert 'hetserve_step_seconds_bucket{kind="mixed",le="+Inf"} 3.0' in lines
    assert 'hetserve_step_time_fit_ratio{kind="mixed"}' in text
    assert 'hetserve_step_time_fit_ratio{kind="decode"}' not in text  # never predicted


def test_layer_slices_are_counted():
    text = ServerMetrics(_Engine(EngineStats(layer_slices=7))).render().decode()
    assert "hetserve_layer_slices_total 7.0" in text.splitlines()
