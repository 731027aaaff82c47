"""`hetserve bench load` on a tiny MoE: every format loads in its own process, the table and JSON
carry load seconds, resident and peak memory and the ratios; llama.cpp is the peer where it
runs, a row with its reason where it does not."""

from __future__ import annotations

import argparse
import json
import sys

from hetserve.bench.load import HEADERS, _measure, _row
from hetserve.cli import main
from hetserve.testing.tiny_gguf import write_gguf


def test_bench_load_end_to_end_writes_json(tiny_model, tmp_path, capsys):
    src = tiny_model("qwen3-moe")
    gguf = write_gguf(src, tmp_path / "m.gguf", tmp_path / "ref", "q8_0", "q8_0")
    out = tmp_path / "load.json"
    rc = main(["bench", "load", "--model", str(src), "--gguf", str(gguf), "--converted",
               str(tmp_path / "int8"), "--rounds", "1", "--context", "64",
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    assert (tmp_path / "int8" / "experts-int8.hsk").is_file()  # converted once, kernel layout
    data = json.loads(out.read_text())
    rows = {r["system"]: r for r in data["results"]}
    ours = ["hetserve gguf", "hetserve safetensors", "hetserve converted, first load",
            "hetserve converted"]  # fmt: skip
    assert list(rows) == [*ours, "llama.cpp"]
    for name in ours:
        r = rows[name]
        assert "error" not in r, r
        assert 0 < r["weights_s"] <= r["ready_s"] < r["first_tokens_s"]
        assert r["after"]["VmHWM"] >= r["after"]["VmRSS"] > r["before"]["VmRSS"] > 0
        assert r["served"]["experts"] > 0 and r["served"]["kv_cache"] > 0
        assert r["ratios"]["peak_over_resident"] >= 1
        assert r["ratios"]["resident_over_bound"] > 0
        grown_peak = r["after"]["VmHWM"] - r["before"]["VmRSS"]
        assert r["ratios"]["peak_grown_over_disk"] == grown_peak / r["disk_bytes"] > 0
        peer_ok = "error" not in rows["llama.cpp"]
        assert (r["ratios"]["resident_vs_llama_cpp"] is not None) == peer_ok
    # the converted checkpoint's experts are resident as file pages (the mapping, read whole
    # by the digest pass)
    first = rows["hetserve converted, first load"]
    assert first["after"]["RssFile"] > first["served"]["experts"]
    text = capsys.readouterr().out
    assert "res vs llama.cpp" in text and "peak grown/disk" in text and "hetserve converted" in text


def test_llama_cpp_missing_is_a_row_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    args = argparse.Namespace(rounds=1, threads=1, context=64)
    got = _measure("llama.cpp", gguf, None, args)
    assert got["error"].startswith("llama-cpp-python is not installed")
    row = _row(got, None)  # the table's row for it: as wide as the table (CI, with no peer)
    assert len(row) == len(HEADERS) and row[:2] == ["llama.cpp", "not run"]


def test_bad_options_exit_2_with_one_line(tmp_path, capsys):
    rc = main(["bench", "load", "--model", str(tmp_path), "--rounds", "0"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "--rounds" in err and "\n" not in err
