"""`hetserve bench kernel-ceiling` on a tiny layer: hot and cold rates per backend over the
same run's bandwidth probe, typed errors."""

from __future__ import annotations

import json

import pytest

from hetserve.cli import main


def test_bench_kernel_ceiling_writes_json(tmp_path, capsys):
    out = tmp_path / "kc.json"
    names = ["cpu-fp32", "cpu-int8"]
    rc = main(["bench", "kernel-ceiling", "--hidden", "64", "--inter", "64", "--top-k", "2",
               "--backends", ",".join(names), "--hot-iters", "2", "--cold-iters", "2",
               "--bandwidth-mib", "8", "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["shape"] == {"hidden": 64, "inter": 64, "top_k": 2}
    assert [r["backend"] for r in data["results"]] == names
    assert data["bandwidth_gbps"]["best"] > 0
    for r in data["results"]:
        assert r["hot_gbps"] > 0 and r["cold_gbps"] > 0
        assert r["hot_over_probe"] == pytest.approx(r["hot_gbps"] / r["probe_gbps"])
        assert r["cold_over_probe"] == pytest.approx(r["cold_gbps"] / r["probe_gbps"])
    assert data["results"][0]["bytes_per_weight"] == 4.0  # fp32
    assert "hot/probe" in capsys.readouterr().out


def test_bench_kernel_ceiling_unknown_backend_is_a_user_error(capsys):
    assert main(["bench", "kernel-ceiling", "--backends", "cpu-int3"]) == 2
    assert "unknown experts backend" in capsys.readouterr().err
