"""The simulator decides with the Conductor's own policy code: every decision it acts on is
`Router.decide` over the view it built; a fresh router replaying a recorded decision log makes
the same choices, whether the log came from the simulator or from the live Conductor's decision
path (its Cluster's instance states and its router)."""

from __future__ import annotations

import asyncio

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


def test_a_live_conductors_decisions_replay_to_the_same_choices(tmp_path):
    """The live Conductor's decision path (its Cluster's instance states, its holdings, its
    router), recorded in the decision-log format and replayed by a fresh router."""
    from hetserve.config import Role
    from hetserve.disagg.conductor import Conductor, ConductorConfig
    from hetserve.disagg.instances import Cluster, Instance

    cluster = Cluster([])
    cluster.block_size = BS
    profile = hardware().profile
    for name, role in (("p0", Role.PREFILL), ("p1", Role.PREFILL), ("d0", Role.DECODE)):
        cluster.instances[name] = Instance(name, f"http://{name}", role, profile, None, BS, b"")
    router = RouterConfig(policy="kvcentric", admission="predictive", slo_ttft_s=0.2)
    path = tmp_path / "live.jsonl"
    log = DecisionLog(str(path), router)
    conductor = Conductor(
        cluster,
        policy.Router(router),
        tokenizer=None,
        config=ConductorConfig(),
        holdings=lambda hashes: {"p1": {"dram": min(len(hashes), 3)}} if len(hashes) > 4 else {},
    )
    recording = conductor.router.decide

    def record(view, req, now):
        decision = recording(view, req, now)
        log.record(view, req, now, decision)
        return decision

    conductor.router.decide = record  # the Conductor's own call, recorded on its way
    seen = []
    for i in range(12):
        cluster.instances["p0"].load = {"queued_prefill_tokens": 40 * i, "queued_requests": i % 3}
        cluster.instances["d0"].load = {"running_decodes": i, "decode_context_tokens": 30 * i}
        body = {"prompt": list(range(8 + 6 * i)), "max_tokens": 4}
        decision, _ = conductor.decide("/v1/completions", body)
        seen.append(decision)
        if not decision.rejected:
            cluster.routed(decision.prefill, decision.decode, 8 + 6 * i - decision.cached_tokens)
    log.close()
    config, rows = read_log(str(path))
    assert [r["decision"]["prefill"] for r in rows] == [d.prefill for d in seen]
    assert {d.prefill for d in seen} == {"p0", "p1"} and any(d.rejected for d in seen)
    assert replay(config, rows) == []
    asyncio.run(cluster.close())
