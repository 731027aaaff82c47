"""`hetserve bench serve` end to end against the fake server, and its handling of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetserve.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _cli(url: str, *extra: str) -> int:
    return main(["bench", "serve", "--base-url", url, "--model", "fake", "--disable-tqdm", *extra])


def test_run_prints_table_and_writes_json_and_plots(fake_server, tmp_path: Path, capsys) -> None:
    server = fake_server(ttft_s=0.01, itl_s=0.005, fail_every=5)
    out = tmp_path / "res" / "result.json"
    rc = _cli(
        server.url,
        "--num-prompts",
        "10",
        "--random-input-len",
        "16",
        "--random-output-len",
        "4",
        "--request-rate",
        "100",
        "--slo",
        "ttft=60000,tpot=60000",
        "--result-file",
        str(out),
        "--plot",
        str(tmp_path / "plots"),
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "Successful requests:" in text and "Mean TTFT (ms):" in text
    assert "Goodput (req/s):" in text and "injected failure" in text
    assert "Poisson 100 req/s" in text
    result = json.loads(out.read_text())
    assert "platform" in result["machine"]  # the layout every hetserve benchmark writes
    m = result["metrics"]
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (8, 2, 32)
    assert m["slo_good_requests"] == 8 and result["arrivals"] == "Poisson 100 req/s"
    assert m["ttft_ms"]["median"] >= 10.0 - 2 and len(result["requests"]) == 10
    for name in ("ttft.png", "tpot.png", "throughput.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == PNG_MAGIC
    sent = server.cfg.received[0]
    assert sent["ignore_eos"] is True and len(sent["prompt"]) == 16


def test_trace_run_reports_prefix_reuse(fake_server, tmp_path: Path, capsys) -> None:
    rows = [
        {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [0, 1]},
        {"timestamp": 10, "input_length": 520, "output_length": 2, "hash_ids": [0, 2]},
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    server = fake_server(ttft_s=0.0, itl_s=0.0, omit_usage=True)
    out = tmp_path / "r.json"
    rc = _cli(
        server.url,
        "--dataset",
        "mooncake-trace",
        "--dataset-path",
        str(trace),
        "--max-model-len",
        "560",
        "--request-rate",
        "inf",
        "--api-key",
        "k",
        "--result-file",
        str(out),
    )
    assert rc == 0
    text = capsys.readouterr().out
    strict = json.loads(out.read_text(), parse_constant=pytest.fail)  # no Infinity/NaN
    assert strict["args"]["request_rate"] == "inf" and "api_key" not in strict["args"]
    assert "Block hit ratio:" in text and "25.0%" in text  # 1 hit of 4 blocks
    assert "changed 1 of 2" in text and "counted from stream" in text
    assert [len(b["prompt"]) for b in server.cfg.received] == [558, 520]
    assert json.loads(out.read_text())["prefix_reuse"]["blocks_hit"] == 1


def test_every_request_failing_exits_1(fake_server, capsys) -> None:
    server = fake_server(fail_every=1)
    assert (
        _cli(
            server.url, "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2"
        )
        == 1
    )
    assert "every request failed" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dataset", "sharegpt"], "needs --dataset-path"),
        (["--dataset", "mooncake-trace", "--dataset-path", "/nonexistent.jsonl"], "not found"),
        (["--slo", "ttft:200"], "--slo"),
        (["--request-rate", "0"], "--request-rate"),
        (["--max-concurrency", "0"], "--max-concurrency"),
        (["--time-scale", "-1"], "--time-scale"),
        (["--random-range-ratio", "1.5"], "--random-range-ratio"),
        (["--max-model-len", "1"], "--max-model-len"),
        (["--result-file", "/"], "is a directory"),
    ],
)
def test_bad_input_exits_2_with_one_line(fake_server, capsys, args, message) -> None:
    server = fake_server()
    assert _cli(server.url, "--num-prompts", "2", *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert server.cfg.received == []  # rejected before any request was sent


def test_bad_base_url_and_missing_model(capsys) -> None:
    assert main(["bench", "serve", "--base-url", "localhost:8000", "--model", "m"]) == 2
    assert "--base-url" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--base-url", "http://127.0.0.1:1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--model" in err and err.count("\n") == 1
