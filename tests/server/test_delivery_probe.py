"""`hetserve profile --through URL`: the delivery around the prefill, measured through a live
server (the session's in-process one), and its mistakes as one line with exit code 2."""

from __future__ import annotations

from hetserve.cli import main
from hetserve.disagg.costs import DecodeFit, InstanceProfile, PrefillFit, load_profile, save_profile
from hetserve.disagg.delivery_probe import probe

# A base that predicts no compute at all: every measured second is delivery, never negative.
BASE = InstanceProfile("base", PrefillFit(0.0, 0.0, 0.0), DecodeFit(0.001, 0.0, 0.0), 2048)


def test_probe_fits_what_the_server_adds_and_keeps_the_base(server):
    seen = []
    profile, samples = probe(
        server.url, BASE, lengths=(8, 64), repeats=2, on_sample=lambda *s: seen.append(s)
    )
    assert [n for n, _ in samples] == [8, 64, 8, 64] and len(seen) == 4
    assert all(ttft > 0 and predicted == 0.0 for _, ttft, predicted in seen)
    d = profile.delivery
    assert d is not None and d.overhead_s >= 0 and d.per_token_s >= 0
    assert d.overhead_s + d.per_token_s * 64 > 0  # the server's wait shows up in the fit
    assert (profile.prefill, profile.decode, profile.name) == (BASE.prefill, BASE.decode, "base")
    assert server.wait_idle().kv_blocks_used == 0


def test_cli_writes_the_base_with_its_delivery(server, tmp_path, capsys):
    base, out = tmp_path / "base.json", tmp_path / "served.json"
    save_profile(str(base), BASE, capacity={"device_kv_tokens": 4096})
    args = ["profile", "--through", server.url, "--base", str(base), "--out", str(out)]
    assert main([*args, "--lengths", "8,32", "--repeats", "1"]) == 0
    loaded, raw = load_profile(str(out))
    assert loaded.delivery is not None and raw["capacity"] == {"device_kv_tokens": 4096}
    assert "delivery:" in capsys.readouterr().out


def test_mistakes_are_one_line_with_exit_code_2(server, tmp_path, capsys):
    base = tmp_path / "base.json"
    save_profile(str(base), BASE)
    out = str(tmp_path / "o.json")
    cases = [
        (["--through", server.url, "--out", out], "--base"),
        (
            ["--through", server.url, "--base", str(base), "--lengths", "8", "--out", out],
            "--lengths",
        ),
        (["--through", "http://127.0.0.1:9", "--base", str(base), "--out", out], "cannot reach"),
        (["--through", server.url, "--base", str(tmp_path / "no.json"), "--out", out], "no.json"),
    ]
    for args, named in cases:
        assert main(["profile", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert named in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o.json").exists()
