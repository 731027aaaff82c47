"""The simulator decides with the Conductor's own policy code: every decision it acts on is
`Router.decide` over the view it built, and a fresh router replaying a recorded log (the format
the live Conductor writes too) makes the same choices."""

from __future__ import annotations

import pytest

from hetserve.disagg import policy
from hetserve.disagg.policy import RouterConfig
from hetserve.sim.decisions import DecisionLog, read_log, replay
from hetserve.sim.loop import SimConfig, Simulation
from tests.sim.conftest import BS, hardware, random_records


@pytest.mark.parametrize(
    "router",
    [
        RouterConfig(policy="kvcentric", admission="predictive", slo_ttft_s=0.5, slo_tbt_s=0.06),
        RouterConfig(policy="random", seed=4),
        RouterConfig(policy="round-robin"),
        RouterConfig(policy="cache-aware", balance_abs=2),
        RouterConfig(policy="tier-credit", admission="threshold", threshold_queue_tokens=200),
    ],
    ids=lambda r: f"{r.policy}-{r.admission}",
)
def test_a_recorded_run_replays_to_the_same_decisions(tmp_path, router):
    records = random_records(150, seed=2, gap_ms=8)
    pre, dec = [hardware() for _ in range(3)], [hardware() for _ in range(2)]
    cfg = SimConfig(router, pre, dec, cache="global", block_tokens=BS)
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(str(path), router)
    res = Simulation(records, cfg, hook=log.record).run()
    log.close()
    config, rows = read_log(str(path))
    assert config == router and len(rows) == len(records)
    assert replay(config, rows) == []
    # The run acted on each decision as recorded.
    for job, row in zip(res.jobs, rows, strict=True):
        d = row["decision"]
        if d["reject_reason"] is not None:
            assert job.rejected == "admission"
        else:
            assert (res.prefill[job.prefill].name, res.decode[job.decode].name) == (
                d["prefill"],
                d["decode"],
            )
            assert job.cached_tokens == d["cached_tokens"]
    assert any(r["decision"]["scores"] for r in rows)


def test_replay_finds_a_decision_the_policy_would_not_make(tmp_path):
    router = RouterConfig(policy="load")
    records = random_records(40, seed=1, gap_ms=8)
    cfg = SimConfig(router, [hardware(), hardware()], [hardware()], block_tokens=BS)
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(str(path), router)
    Simulation(records, cfg, hook=log.record).run()
    log.close()
    config, rows = read_log(str(path))
    rows[5]["decision"]["prefill"] = "p1" if rows[5]["decision"]["prefill"] == "p0" else "p0"
    assert [m["index"] for m in replay(config, rows)] == [5]


def test_the_simulator_calls_the_policy_module_itself(monkeypatch):
    calls = []
    real = policy.Router.decide

    def spy(self, view, req, now):
        calls.append(req.request_id)
        return real(self, view, req, now)

    monkeypatch.setattr(policy.Router, "decide", spy)
    records = random_records(30, seed=1)
    cfg = SimConfig(RouterConfig(), [hardware()], [hardware()], block_tokens=BS)
    Simulation(records, cfg).run()
    assert calls == [str(i) for i in range(30)]
