"""`hetserve sim` end to end: tables, JSON with its own wall time and event rate, plots, bad
input as one line and exit 2, --search, and the digital twin's replay path (a request log and
a profile JSON, nothing else)."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from hetserve.cli import main
from hetserve.core.trace_record import RequestLogWriter, log_record
from hetserve.disagg.costs import save_profile
from hetserve.disagg.policy import RouterConfig
from hetserve.sim.hardware import from_profile_file
from hetserve.sim.loop import SimConfig, Simulation
from tests.sim.conftest import hardware, random_records

SYNTHETIC = Path("/work/shared/data/mooncake/synthetic_trace.jsonl")


def write_trace(path: Path, records) -> str:
    path.write_text("".join(r.to_json() + "\n" for r in records))
    return str(path)


def test_runs_print_a_table_and_write_json_and_plots(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", random_records(120, seed=4, gap_ms=20))
    out = tmp_path / "r.json"
    rc = main(
        [
            "sim",
            "--trace",
            trace,
            "--prefill",
            "3",
            "--decode",
            "2",
            "--policy",
            "kvcentric",
            "--cache",
            "local,global",
            "--rate-sweep",
            "1,3",
            "--cache-sweep",
            "8,64",
            "--slo",
            "ttft=2s,tbt=80ms",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "plots"),
            "--hardware",
            "llama3-70b-a800",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "policy" in text and "kvcentric" in text and "wall" in text
    data = json.loads(out.read_text())
    assert len(data["runs"]) == 2 * 2 * 2
    assert data["wall_s"] > 0 and data["events"] > 0 and data["events_per_s"] > 0
    run = data["runs"][0]
    for key in (
        "cache_hit_rate",
        "prefill_compute_s",
        "ttft_s",
        "tbt_s",
        "effective_ratio",
        "rejected_admission",
        "rejected_decode",
        "goodput_per_dollar",
        "events_per_s",
    ):
        assert key in run
    assert set(run["ttft_s"]) == {"mean", "p50", "p90", "p99"}
    assert any("hot_block_replicas" in r for r in data["runs"] if r["cache"] == "global")
    plots = {p.name for p in (tmp_path / "plots").iterdir()}
    assert plots == {"ttft_vs_rate.png", "hit_rate_vs_cache.png", "hot_block_replicas.png"}


@pytest.mark.parametrize(
    "args, words",
    [
        (["--policy", "fastest"], "--policy: 'fastest'"),
        (["--slo", "ttft=fast"], "--slo"),
        (["--prefill", "x:y"], "--prefill"),
        (["--hardware", "tpu-v9"], "--hardware 'tpu-v9'"),
        (["--block-tokens", "6"], "--block-tokens 6 must be a multiple"),
        (["--rate-sweep", "1,-2"], "--rate-sweep"),
        (["--decode", "0"], "at least one instance"),
        (["--search", "prefill=4-2"], "--search"),
        (["--goal", "0.9"], "give --search too"),  # was ignored in silence
        (["--search", "prefill=1-2,decode=1-2", "--goal", "2"], "--goal must be in (0, 1]"),
        (["--price", "foo=3"], "'foo' is no hardware in this run"),  # was ignored in silence
    ],
)
def test_bad_options_are_one_line_and_exit_2(tmp_path, capsys, args, words):
    trace = write_trace(tmp_path / "t.jsonl", random_records(5, seed=1))
    assert main(["sim", "--trace", trace, *args]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1


def test_a_bad_trace_names_its_line_from_the_command_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [2]}\n'
    )
    assert main(["sim", "--trace", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --trace:") and "line 2" in err and "unsorted" not in err
    assert len(err.strip().splitlines()) == 1


def test_search_finds_the_cheapest_mix_meeting_the_goal(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", random_records(150, seed=6, gap_ms=2))
    out = tmp_path / "s.json"
    rc = main(
        [
            "sim",
            "--trace",
            trace,
            "--search",
            "prefill=1-4,decode=1-3",
            "--goal",
            "0.9",
            "--slo",
            "ttft=200ms,tbt=100ms",
            "--prefill",
            "1:llama3-70b-h800",
            "--decode",
            "1:llama3-70b-h20",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())["search"]
    best = result["cheapest"]
    assert best is not None and best["meets_goal"]
    cheaper = [r for r in result["evaluated"] if r["cost_per_hour"] < best["cost_per_hour"]]
    assert all(not r["meets_goal"] for r in cheaper)
    assert "cheapest mix" in capsys.readouterr().out


def synthetic_log(path: Path, n: int, seed: int) -> list:
    """A request log as `serve --log-requests` writes it: real block hashes of token ids that
    share system prompts and conversation turns; measurements added later."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(64)] for _ in range(3)]
    convs: list[list[int]] = []
    records = []
    for i in range(n):
        if convs and rng.random() < 0.6:
            conv = rng.choice(convs)
        else:
            conv = list(rng.choice(systems))
            convs.append(conv)
        conv.extend(rng.randrange(1000) for _ in range(rng.randint(8, 40)))
        records.append(log_record(i * 0.05, list(conv), rng.randint(2, 20), 16, extra=("demo",)))
    return records


def test_digital_twin_replays_a_request_log_with_a_profile(tmp_path, capsys):
    hw = hardware(cache_tokens=4096, device_tokens=100_000)
    profile = tmp_path / "profile.json"
    save_profile(
        str(profile), hw.profile, capacity={"device_kv_tokens": 100_000, "host_kv_tokens": 4096}
    )
    records = synthetic_log(tmp_path, 80, seed=3)
    # "Measure" the cluster: here the simulator itself stands in for `cluster up`, so the twin
    # must reproduce it exactly; the live comparison replaces these numbers with real ones.
    box = from_profile_file(str(profile))
    cfg = SimConfig(RouterConfig(), [box], [box], cache="local", block_tokens=16)
    truth = Simulation(records, cfg).run()
    log = tmp_path / "requests.log"
    writer = RequestLogWriter(str(log))
    for rec, job in zip(records, truth.jobs, strict=True):
        assert job.ttft is not None
        writer.write(replace(rec, ttft_ms=1000 * job.ttft, cached_tokens=job.cached_tokens))
    writer.close()
    out = tmp_path / "twin.json"
    rc = main(
        [
            "sim",
            "--trace",
            str(log),
            "--hardware",
            str(profile),
            "--prefill",
            "1",
            "--decode",
            "1",
            "--cache",
            "local",
            "--slo",
            "none",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    twin = json.loads(out.read_text())["runs"][0]["twin"]
    assert twin["ttft_error"] == pytest.approx(0.0, abs=1e-9)
    assert twin["reuse_diff_pp"] == pytest.approx(0.0, abs=1e-9) and twin["reuse_measured"] > 0.2
    assert "digital twin" in capsys.readouterr().out


@pytest.mark.skipif(not SYNTHETIC.is_file(), reason="the Mooncake synthetic trace is absent")
def test_the_published_trace_runs_on_the_paper_hardware(capsys):
    rc = main(
        [
            "sim",
            "--trace",
            str(SYNTHETIC),
            "--limit",
            "400",
            "--prefill",
            "4",
            "--decode",
            "4",
            "--policy",
            "kvcentric",
            "--cache",
            "local,global",
        ]
    )
    assert rc == 0
    assert "kvcentric" in capsys.readouterr().out


def test_a_decode_instances_log_alone_is_refused_not_misread(tmp_path, capsys):
    """Its cached tokens counted the KV handed over by the prefill instance: replayed alone it
    read as 99.8% prefix reuse against 4.5% predicted. Hand-off tokens are logged apart now,
    and such a log alone is refused with what to replay instead."""
    records = [replace(r, cached_tokens=0, handoff_tokens=r.input_length - 1)
               for r in random_records(5, seed=3)]  # fmt: skip
    trace = write_trace(tmp_path / "decode-0.jsonl", records)
    assert main(["sim", "--trace", trace]) == 2
    err = capsys.readouterr().err
    assert "decode instance's log" in err and "--log-requests" in err


def test_the_request_log_counts_handed_off_kv_apart_from_cached(tmp_path):
    from types import SimpleNamespace

    from hetserve.core.outputs import CompletionOutput, RequestOutput
    from hetserve.server.request_log import RequestLogger

    path = tmp_path / "decode-0.jsonl"
    rlog = RequestLogger(str(path), 16, b"")
    reply = CompletionOutput(0, "x", [7, 8], None, "stop")
    out = RequestOutput("r", None, list(range(40)), [reply], finished=True, num_cached_tokens=39,
                        cached_tokens_by_tier={"handoff": 32, "device": 7})  # fmt: skip
    timing = SimpleNamespace(arrival=0.0, first_token=0.1, token_times=[0.1, 0.2], caller_id=None)
    rlog.observe("r", out, timing)
    rlog.close()
    row = json.loads(path.read_text())
    assert row["cached_tokens"] == 7 and row["handoff_tokens"] == 32
