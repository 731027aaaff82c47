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
        (["--burst", "0"], "--burst"),
        (["--burst", "8", "--burst-delay", "-1"], "--burst-delay"),
        (["--burst", "4000", "--burst-output-len", "100"], "exceed the context"),
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


def test_vocabulary_and_context_come_from_the_server(fake_server, capsys) -> None:
    server = fake_server(ttft_s=0.0, itl_s=0.0, card={"id": "fake", "vocab_size": 50,
                                                      "max_model_len": 40})  # fmt: skip
    rc = _cli(server.url, "--num-prompts", "20", "--random-input-len", "100",
              "--random-output-len", "8", "--random-range-ratio", "0.5")  # fmt: skip
    assert rc == 0
    sent = server.cfg.received
    assert len(sent) == 20
    assert all(len(b["prompt"]) + b["max_tokens"] <= 40 for b in sent)
    ids = {t for b in sent for t in b["prompt"]}
    assert min(ids) >= 10 and max(ids) == 49  # below the vocabulary, clear of the low specials
    assert "vocabulary 50 (server /v1/models), context 40 (server /v1/models)" in (
        capsys.readouterr().out
    )


def test_no_vocabulary_anywhere_exits_2_naming_the_fix(fake_server, capsys) -> None:
    server = fake_server(card={"id": "fake", "max_model_len": 4096})  # what vLLM reports
    assert _cli(server.url, "--num-prompts", "2") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "--tokenizer DIR" in err and "--vocab-size N" in err
    assert server.cfg.received == []
    # Chat sends words, not ids: the vocabulary does not matter there.
    assert _cli(server.url, "--num-prompts", "2", "--endpoint", "/v1/chat/completions") == 0


def test_tokenizer_dir_gives_vocabulary_and_special_tokens(fake_server, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 30, "eos_token_id": 12}))
    server = fake_server(ttft_s=0.0, itl_s=0.0, card=None)  # a server without /v1/models
    rc = _cli(server.url, "--num-prompts", "30", "--random-input-len", "40",
              "--random-output-len", "2", "--tokenizer", str(tmp_path))  # fmt: skip
    assert rc == 0
    ids = {t for b in server.cfg.received for t in b["prompt"]}
    assert ids == set(range(30)) - {12}


def test_unreachable_server_exits_2_before_any_load(fake_server, capsys) -> None:
    server = fake_server()
    server.stop()
    assert _cli(server.url, "--num-prompts", "2") == 2
    err = capsys.readouterr().err
    assert "cannot reach" in err and err.count("\n") == 1


def test_burst_sends_long_prompts_into_the_streams(fake_server, tmp_path: Path, capsys) -> None:
    """Two streams, two long prompts 0.2 s in, one more alone afterwards: the streams' ITL
    before the burst is the decode-only baseline (the fake's 10 ms between tokens)."""
    server = fake_server(ttft_s=0.01, itl_s=0.01)
    out = tmp_path / "burst.json"
    rc = _cli(server.url, "--num-prompts", "2", "--random-input-len", "8",
              "--random-output-len", "40", "--request-rate", "inf", "--burst", "300",
              "--burst-count", "2", "--burst-delay", "0.2", "--burst-output-len", "3",
              "--result-file", str(out))  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "Max ITL (ms):" in text and "P99 ITL / decode-only median:" in text
    result = json.loads(out.read_text())
    rows = result["requests"]
    assert sorted(r["role"] for r in rows) == ["burst", "burst", "stream", "stream"]
    assert all(r["send_s"] >= 0.2 for r in rows if r["role"] == "burst")
    assert [len(b["prompt"]) for b in server.cfg.received[2:]] == [300, 300, 300]  # + solo
    assert server.cfg.received[0]["stream_options"]["continuous_usage_stats"] is True
    assert len({tuple(b["prompt"]) for b in server.cfg.received[2:]}) == 3  # no shared prefix
    b = result["metrics"]["burst"]
    assert b["decode_only_samples"] >= 2 * 10
    assert b["decode_only_itl_ms"]["median"] >= 10.0 - 2
    assert b["stream_itl_ms"]["max"] >= b["stream_itl_ms"]["p99"] >= b["stream_itl_ms"]["median"]
    assert b["burst_ttft_ms"]["max"] is not None and b["solo_ttft_ms"]["median"] is not None
    base = b["decode_only_itl_ms"]["median"]
    assert b["itl_p99_over_decode_only"] == b["stream_itl_ms"]["p99"] / base
    token_base = b["decode_only_token_itl_ms"]["median"]
    assert token_base >= 10.0 - 2  # the fake sends one token a chunk: per token = per chunk
    assert b["token_itl_max_over_decode_only"] == b["stream_token_itl_ms"]["max"] / token_base
    assert result["metrics"]["completed"] == 4  # the solo prompt is not counted with the run
