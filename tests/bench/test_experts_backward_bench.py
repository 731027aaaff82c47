"""`hetserve bench experts-backward` on a tiny layer: the three calls timed, against torch's
backward and the GEMM peak of the same run, typed errors."""

from __future__ import annotations

import json

import pytest

from hetserve.cli import main


def test_bench_experts_backward_writes_json(tmp_path, capsys):
    out = tmp_path / "eb.json"
    rc = main(["bench", "experts-backward", "--experts", "4", "--hidden", "64", "--inter", "32",
               "--tokens", "16", "--top-k", "2", "--calls", "2", "--repeats", "1",
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["shape"] == {"experts": 4, "hidden": 64, "inter": 32, "tokens": 16, "top_k": 2}
    assert set(data["results"]) == {"forward", "backward", "torch_backward"}
    peak = data["gemm_peak_gflops"]
    for r in data["results"].values():
        assert r["ms"] > 0 and r["of_gemm_peak"] == pytest.approx(r["gflops"] / peak)
    res = data["results"]
    assert data["backward_speedup_vs_torch"] == pytest.approx(
        res["torch_backward"]["ms"] / res["backward"]["ms"]
    )
    assert data["backward_kernel"] in ("native", "torch")
    assert "of GEMM peak" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--experts", "4", "--top-k", "5"], "--top-k 5 is more than --experts 4"),
        (["--hidden", "96", "--bits", "4"], "--bits 4 quantizes in groups of 64"),
        (["--calls", "0"], "--calls must be >= 1"),
    ],
)
def test_bench_experts_backward_bad_options_are_user_errors(args, message, capsys):
    assert main(["bench", "experts-backward", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
