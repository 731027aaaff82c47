import subprocess
import sys


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "hetserve.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_make_tiny_and_generate(tmp_path):
    for arch, extra in (("mixtral", []), ("qwen3-next", ["--num-experts", "4"])):
        out = tmp_path / arch
        r = run("models", "make-tiny", "--arch", arch, str(out), "--hidden-size", "32", *extra)
        assert r.returncode == 0, r.stderr
        # readable by others as the files beside them (safetensors wrote them 0600)
        modes = {p.suffix: p.stat().st_mode & 0o777 for p in out.iterdir()}
        assert modes[".safetensors"] == modes[".json"]
        r = run("generate", "--model", str(out), "--max-tokens", "3", "--json", "hello")
        assert r.returncode == 0, r.stderr
        assert '"finish_reason"' in r.stdout


def test_make_tiny_says_when_the_vocabulary_is_larger_than_asked(tmp_path):
    r = run("models", "make-tiny", "--arch", "qwen3-moe", str(tmp_path / "v"), "--vocab-size",
            "10", "--hidden-size", "32")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "note: vocab_size is" in r.stdout and "not 10" in r.stdout  # it was silent


def test_user_errors_exit_2_with_one_line(tmp_path):
    for args in (
        ["generate", "--model", str(tmp_path / "missing"), "hi"],
        ["models", "make-tiny", "--arch", "nope", str(tmp_path / "x")],
        ["models", "make-tiny", str(tmp_path / "x")],
        ["generate", "--speculative-config", '{"method": "eagle"}', "hi"],
        ["generate", "--speculative-config", "{bad", "hi"],
    ):
        r = run(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error:")


def test_calibrate_then_generate_with_hot_experts(tmp_path, tiny_model):
    model = str(tiny_model("qwen3-moe"))
    stats = tmp_path / "stats.json"
    r = run(
        "calibrate",
        "--model",
        model,
        "--out",
        str(stats),
        "--num-prompts",
        "3",
        "--prompt-len",
        "24",
        "--max-tokens",
        "2",
    )
    assert r.returncode == 0, r.stderr
    import json

    data = json.loads(stats.read_text())
    assert set(data["layers"]) == {"0", "1"}
    r = run(
        "generate",
        "--model",
        model,
        "--placement",
        "default",
        "--gpu-experts",
        "2",
        "--routing-stats",
        str(stats),
        "--max-tokens",
        "3",
        "--json",
        "hi",
    )
    assert r.returncode == 0, r.stderr


def test_placement_user_errors_exit_2(tmp_path, tiny_model):
    model = str(tiny_model("qwen3-moe"))
    bad = tmp_path / "rules.yaml"
    bad.write_text("rules:\n  - name: x\n    match: 'model\\.nothing'\n    device: cpu\n")
    for args in (
        ["--placement", str(bad)],
        ["--placement", str(tmp_path / "missing.yaml")],
        ["--gpu-experts", "2"],
        ["--placement", "default", "--gpu-experts", "2"],
    ):
        r = run("generate", "--model", model, *args, "hi")
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith("error:") and "Traceback" not in r.stderr, r.stderr
