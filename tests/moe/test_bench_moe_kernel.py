"""`hetserve bench moe-kernel` on a tiny shape: table, JSON, typed errors."""

from __future__ import annotations

import json

from hetserve.cli import main


def test_bench_moe_kernel_writes_json(tmp_path, capsys):
    from hetserve.native import native_unavailable_reason

    out = tmp_path / "moe.json"
    names = ("cpu-fp32", "cpu-int8", "cpu-int4:library")
    if native_unavailable_reason() is None:  # the published formats exist only natively
        names += ("cpu-mxfp4", "cpu-fp8")
    rc = main(
        ["bench", "moe-kernel", "--hidden", "64", "--inter", "64", "--experts", "8", "--top-k",
         "2", "--tokens", "1,3", "--iters", "2", "--bandwidth-mib", "8",
         "--backends", ",".join(names), "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["bandwidth_gbps"]["best"] > 0
    rows = {(r["backend"], r["tokens"]) for r in data["results"]}
    assert rows == {(b, t) for b in names for t in (1, 3)}
    assert all(r["gbps_best"] > 0 and r["ratio_best"] > 0 for r in data["results"])
    assert "ratio best" in capsys.readouterr().out


def test_bench_moe_kernel_unknown_backend_is_a_user_error(capsys):
    assert main(["bench", "moe-kernel", "--backends", "cpu-int3"]) == 2
    assert "unknown experts backend" in capsys.readouterr().err
