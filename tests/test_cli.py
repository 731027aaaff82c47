import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "hetserve.cli", *args],
                          capture_output=True, text=True, timeout=300)


def test_make_tiny_and_generate(tmp_path):
    out = tmp_path / "m"
    r = run("models", "make-tiny", "--arch", "mixtral", str(out), "--hidden-size", "32")
    assert r.returncode == 0, r.stderr
    r = run("generate", "--model", str(out), "--max-tokens", "3", "--json", "hello")
    assert r.returncode == 0, r.stderr
    assert '"finish_reason"' in r.stdout


def test_user_errors_exit_2_with_one_line(tmp_path):
    for args in (["generate", "--model", str(tmp_path / "missing"), "hi"],
                 ["models", "make-tiny", "--arch", "nope", str(tmp_path / "x")],
                 ["models", "make-tiny", str(tmp_path / "x")]):
        r = run(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error:")
