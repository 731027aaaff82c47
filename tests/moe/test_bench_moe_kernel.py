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
    assert data["bandwidth_gbps"]["best"] > 0 and data["machine"]  # the machine's facts too
    rows = {(r["backend"], r["tokens"]) for r in data["results"]}
    assert rows == {(b, t) for b in names for t in (1, 3)}
    assert all(r["gbps_best"] > 0 and r["ratio_best"] > 0 for r in data["results"])
    # native rows also time the same reads without the arithmetic; the library one cannot
    for r in data["results"]:
        native = r["backend"] != "cpu-int4:library" and native_unavailable_reason() is None
        for key in ("kernel_ratio_median", "touch_ratio_median", "of_touch_median"):
            assert (r[key] is not None) == native, key
            assert not native or r[key] > 0, key
        if native:  # the kernel alone is faster than the call from Python around it
            assert r["kernel_ratio_median"] >= r["ratio_median"]
    out = capsys.readouterr().out
    assert "of touch" in out and "kernel" in out


def test_bench_moe_kernel_unknown_backend_is_a_user_error(capsys):
    assert main(["bench", "moe-kernel", "--backends", "cpu-int3"]) == 2
    assert "unknown experts backend" in capsys.readouterr().err


def test_bench_moe_kernel_gguf_formats(tmp_path):
    import pytest

    from hetserve.native import native_unavailable_reason

    if native_unavailable_reason() is not None:
        pytest.skip("q4_K experts run only on the native kernel")
    out = tmp_path / "moe.json"
    # the i-quants from llama.cpp's quantizer where it is installed, else random valid blocks
    names = ("cpu-int4:q4_K", "cpu-int8:q8_0", "cpu-gguf:q6_K", "cpu-gguf:iq4_xs",
             "cpu-gguf:iq4_nl")  # fmt: skip
    rc = main(
        ["bench", "moe-kernel", "--hidden", "256", "--inter", "256", "--experts", "4", "--top-k",
         "2", "--tokens", "1,16", "--iters", "2", "--bandwidth-mib", "8",
         "--backends", ",".join(names), "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    # 16 tokens: the prefill tiles' items (their reads timed alone too, sized by the pairs)
    assert [(r["backend"], r["tokens"]) for r in rows] == [(n, t) for n in names for t in (1, 16)]
    assert all(r["ratio_median"] > 0 and r["probe_gbps_best"] > 0 for r in rows)


def test_bench_moe_kernel_q4k_needs_rows_of_256(capsys):
    args = ["bench", "moe-kernel", "--inter", "1408", "--backends", "cpu-int4:q4_K"]
    assert main(args) == 2
    assert "--inter 1536" in capsys.readouterr().err
