"""`hetserve bench health` against the real `hetserve serve` (demo model) with small bodies:
the idle polls, every body posted, its polls and ratios in the JSON; typed errors."""

from __future__ import annotations

import json

import pytest

from hetserve.cli import main


def test_bench_health_polls_while_posting(demo_server, tmp_path, capsys):
    out = tmp_path / "health.json"
    rc = main(["bench", "health", "--url", demo_server.url, "--max-request-mb", "0.25",
               "--repeats", "2", "--idle-s", "0.3", "--json", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["goal_ms"] == 100.0 and data["idle"]["polls"] > 0
    limit = 0.25 * (1 << 20)
    assert [b["body"] for b in data["bodies"]] == ["text", "token ids", "token ids, compact"]
    for b in data["bodies"]:
        assert 0.9 * limit < b["bytes"] < limit  # just under the server's limit
        assert len(b["statuses"]) == len(b["post_ms"]) == len(b["worst_per_post_ms"]) == 2
        assert all(400 <= s < 500 for s in b["statuses"])  # longer than the demo's context
        if b["polls"]:
            assert b["worst_vs_idle"] == pytest.approx(b["worst_ms"] / data["idle"]["worst_ms"])
            assert b["within_goal"] == (b["worst_ms"] <= 100.0)
    assert "worst vs idle" in capsys.readouterr().out


def test_bench_health_unreachable_server_is_one_line(capsys):
    rc = main(["bench", "health", "--url", "http://127.0.0.1:9", "--idle-s", "0.1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: http://127.0.0.1:9/health") and err.count("\n") == 1


def test_bench_health_needs_a_url(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "health"])
    assert exc.value.code == 2
    assert "--url" in capsys.readouterr().err
