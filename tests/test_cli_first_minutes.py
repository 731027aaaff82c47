"""The command line as a new user first meets it: help and version, a bad or busy port refused
before the model loads, and `hetserve chat` with commands and a check of the server."""

import argparse
import io
import json
import socket
import sys

import pytest

from hetserve.cli import main


def test_bare_hetserve_is_help_with_examples(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "hetserve serve" in out and "COMMAND" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("hetserve ")


@pytest.mark.parametrize("port", [80000, 0])
def test_impossible_port_is_one_line_before_loading(port, capsys):
    assert main(["serve", "--model", "/nonexistent", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--port must be in 1..65535" in err


def test_busy_port_is_one_line_before_loading(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        # /nonexistent would fail to load: the port check must come first
        assert main(["serve", "--model", "/nonexistent", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "in use" in err


def test_chat_checks_the_server_first(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["chat", "--url", f"http://127.0.0.1:{port}"]) == 2
    assert "is the server running" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,text",
    [
        (["--temperature", "-1"], "--temperature: temperature must be"),
        (["--max-tokens", "0"], "--max-tokens: max_tokens must be"),
        (["--url", "127.0.0.1:8000"], "--url 127.0.0.1:8000 needs its scheme: http://127.0.0.1:8000"),
    ],
)
def test_chat_flags_are_checked_before_anything_loads(flags, text, monkeypatch, capsys):
    """Before the model loads or the server is asked, not after the first message."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", "/nonexistent", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and text in err, err


@pytest.mark.parametrize("flag,path", [("--log-decisions", "missing/dir/x"), ("--plot", "afile")])
def test_an_output_path_that_cannot_be_written_is_one_line(tmp_path, capsys, flag, path):
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": t, "input_length": 600, "output_length": 4, "hash_ids": [t, t + 1]}
            for t in (0, 10)]  # fmt: skip
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "afile").write_text("a file where a directory is wanted")
    out = str(tmp_path / path)
    assert main(["sim", "--trace", str(trace), flag, out]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: {flag} {out}:"), err
    assert "simulating" not in captured.out  # refused before the work, not after it



def _tiny_config(**patch) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 32, "num_hidden_layers": 1, **patch}  # fmt: skip


GENERATE = ["generate", "--model", "{d}", "hi"]
EXPORT = ["export", "--model", "{d}", "--adapter", "{d}", "--out", "{d}/out"]


@pytest.mark.parametrize(
    "command,text,needle",
    [
        *[(c, "{bad", "is not valid JSON") for c in (GENERATE, EXPORT)],
        *[(c, "[1, 2]", "must hold a JSON object") for c in (GENERATE, EXPORT)],
        (GENERATE, json.dumps(_tiny_config(num_key_value_heads=3)), "must be a multiple of"),
        (GENERATE, json.dumps(_tiny_config(max_position_embeddings=0)), "is 0; it must be >= 2"),
        (GENERATE, json.dumps(_tiny_config(hidden_size="x")), "not a number"),
    ],
)
def test_a_broken_config_json_is_one_line(tmp_path, capsys, command, text, needle):
    """Each command that reads a model directory names the file and what is wrong with it
    (generate read it first without a check: JSONDecodeError and AttributeError tracebacks;
    export took a JSON array; heads the KV heads do not divide failed at the first prompt)."""
    (tmp_path / "config.json").write_text(text)
    assert main([a.replace("{d}", str(tmp_path)) for a in command]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err, err


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as done:  # argparse's own one-line errors
        return int(done.code or 0)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["serve", "--log-level", "bogus"], "invalid choice: 'bogus'"),
        (["store", "master", "--port", "99999"], "invalid port value"),
        (["conductor", "--both", "http://127.0.0.1:1", "--port", "99999"], "--port must be"),
        (["conductor", "--both", "127.0.0.1:1"], "--both wants an instance's http://HOST:PORT"),
        (["serve", "--role", "decode", "--handoff-links", "0"], "--handoff-links must be 1..16"),
        (["serve", "--kv-events", "udp://1:2"], "--kv-events: expected a tcp://HOST:PORT"),
        (["serve", "--bogus"], "--bogus (see `hetserve serve --help`)"),  # the command's help
        (["cluster", "up", "--bogus"], "(see `hetserve cluster up --help`)"),
        (["cluster", "up", "--policy", "bogus"], "policy 'bogus': choose from"),
        (["cluster", "up", "--port", "99999"], "--port must be in 1..65535"),
        (["cluster", "up", "--config", "{cfg}"], "prefill: 'abc' should be int"),
        (["bench", "conductor", "--policies", "kvcentric,bogus"], "--policies: 'bogus'"),
        (["chat", "--url", "ftp://x"], "use http:// or https://"),
        (["models", "make-tiny", "--arch", "qwen3-moe", "{out}", "--hidden-size", "0"],
         "hidden_size is 0"),
        (["models", "make-tiny", "--arch", "qwen3-moe", "{out}", "--num-attention-heads", "4",
          "--num-key-value-heads", "3"], "must be a multiple of num_key_value_heads"),
        (["models", "make-tiny", "--arch", "qwen3-moe", "{out}", "--num-experts", "4",
          "--num-experts-per-tok", "6"], "num_experts_per_tok (6) is more than the 4"),
        (["models", "make-tiny", "--arch", "qwen3-moe", "{out}", "--num-experts", "0"],
         "top_k=2 must be in [1, num_experts=0]"),  # the model's own check: a traceback
        (["convert", "--quant", "int8", "--group-size", "32", "/nonexistent", "{out}"],
         "--group-size is for --quant int4"),
        (["generate", "--model", "/nonexistent", "--placement", "bogus", "hi"],
         "neither a preset (auto, device, hybrid, all-int8) nor a rules file"),
        # found after every prompt had run (the path), or a file of 0 layers written
        (["calibrate", "--out", "/nonexistent/d/s.json"], "directory '/nonexistent/d'"),
        (["calibrate", "--out", "{out}", "--num-prompts", "0"], "--num-prompts must be >= 1"),
    ],
)
def test_flags_are_checked_before_anything_starts(tmp_path, capsys, argv, needle):
    """Each was a traceback, or an error only after the instances or the model had loaded."""
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text("prefill: abc\n")
    out = tmp_path / "tiny"
    argv = [a.replace("{cfg}", str(cfg)).replace("{out}", str(out)) for a in argv]
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err, err
    assert not out.exists()  # nothing written


def test_checkpoints_are_written_to_a_new_directory(tmp_path, capsys):
    """make-tiny and convert wrote beside what a directory held: an earlier checkpoint's shards
    were then read with the new one."""
    old = tmp_path / "old"
    old.mkdir()
    (old / "model-00001-of-00002.safetensors").write_bytes(b"x")
    for argv in (
        ["models", "make-tiny", "--arch", "qwen3-moe", str(old)],
        ["convert", "--quant", "int8", str(tmp_path), str(old)],
    ):
        assert _exit_code(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "exists and is not empty" in err, err
        assert [p.name for p in old.iterdir()] == ["model-00001-of-00002.safetensors"]


def test_a_missing_model_directory_is_named_as_missing():
    from hetserve.errors import ModelNotFoundError
    from hetserve.model.tokenizer import Tokenizer

    with pytest.raises(ModelNotFoundError, match="does not exist"):
        Tokenizer("/nonexistent/model")


def test_output_paths_are_checked_before_the_work(tmp_path, capsys):
    """serve's routing statistics were lost at Ctrl-C, profile's measurement at its end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    missing = str(tmp_path / "nodir" / "x.json")
    for argv in (
        ["serve", "--model", "/nonexistent", "--port", port, "--save-routing-stats", missing],
        ["profile", "--model", "/nonexistent", "--out", missing],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "does not exist" in err and "nodir" in err, err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--slo-ttft-ms", "0"], "SLOs must be positive milliseconds"),
        (["--slo-tbt-ms", "-5"], "SLOs must be positive milliseconds"),
        (["--admission", "predictive"], "admission predictive needs --slo-ttft-ms"),
        (["--host", "0.0.0.0"], "refusing to bind 0.0.0.0 without an API key"),
        (["--ray-resources", "decode=CPU"], "--ray-resources wants ROLE=NAME:N"),
        (["--launcher", "ray", "--ray-resources", "gpu=CPU:1"], "'gpu' is no instance role"),
        (["--launcher", "ray", "--ray-resources", "decode=CPU:-1"], "should be a number >= 0"),
        (["--ray-resources", "decode=CPU:1"], "ray_resources are for --launcher ray"),
        (["--role-args", "prefill"], "--role-args wants ROLE=OPTIONS"),
        (["--role-args", "gpu=--dtype float32"], "role_args: 'gpu' is no instance role"),
        (["--role-args", "decode=--dtype 'float32"], "role_args: decode: No closing quotation"),
        (["--instance-args", "--dtype 'float32"], "--instance-args: No closing quotation"),
    ],
)
def test_cluster_up_checks_the_conductors_slos_before_the_instances_start(
    monkeypatch, capsys, argv, needle
):
    """The Conductor checked them, but it starts last: after the store and every instance
    had loaded, 'the cluster did not start: conductor exited (2): ...'."""
    from hetserve.disagg.launch import LocalLauncher

    def start(self, spec):
        raise AssertionError("the cluster was started")

    monkeypatch.setattr(LocalLauncher, "start", start)
    assert main(["cluster", "up", "--port", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err, err


@pytest.mark.parametrize(
    "argv,printed",
    [
        (["bench", "conductor", "--instances", "4", "--prompt-tokens", "64", "--repeats", "1"],
         "decide"),
        (["sim", "--trace", "{trace}"], "simulating"),
    ],
)
@pytest.mark.parametrize("where", ["{d}", "{d}/afile/x.json"])
def test_a_json_path_that_cannot_be_written_is_refused_before_the_work(
    tmp_path, capsys, argv, printed, where
):
    """The benches and sim wrote --json only after the work: a directory given, or a file where
    its directory should be, was an OSError once the run had been paid for."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 4,
                                 "hash_ids": [0, 1]}) + "\n")  # fmt: skip
    (tmp_path / "afile").write_text("a file where a directory is wanted")
    out = where.replace("{d}", str(tmp_path))
    argv = [a.replace("{trace}", str(trace)) for a in argv]
    assert main([*argv, "--json", out]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: --json {out}:"), err
    assert printed not in captured.out


def test_bench_json_directories_are_made_by_every_bench(tmp_path):
    """moe-kernel wrote its JSON without making the directory the other benches make."""
    out = tmp_path / "new" / "mk.json"
    argv = ["bench", "moe-kernel", "--hidden", "64", "--inter", "32", "--experts", "4",
            "--top-k", "2", "--tokens", "1", "--iters", "1", "--backends", "cpu-fp32",
            "--bandwidth-mib", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(out.read_text())["bench"] == "moe-kernel"


def test_cluster_config_values_are_checked_as_their_keys_take_them(tmp_path, monkeypatch, capsys):
    """A key was checked against its flag's value when the flag was given (slo_ttft_ms: 300
    beside --slo-ttft-ms 500 was 'should be float'), and not at all otherwise (slo_ttft_ms:
    fast reached the launcher)."""
    from hetserve.disagg.launch import LocalLauncher

    started = []
    monkeypatch.setattr(LocalLauncher, "start", lambda self, spec: started.append(spec) or 1)
    monkeypatch.setattr(LocalLauncher, "wait", lambda self: 0, raising=False)
    cfg = tmp_path / "c.yaml"
    for text, argv, needle in (
        ("slo_ttft_ms: fast\n", [], "slo_ttft_ms: 'fast' should be float"),
        ("prefill: true\n", [], "prefill: True should be int"),
        ("store_dram: 4\n", [], "store_dram: 4 should be str"),
        ("restart: no-thanks\n", [], "restart: 'no-thanks' should be bool"),
        ("launcher: ray\nray_resources: [1]\n", [], "ray_resources: [1] should be dict"),
        ("launcher: ray\nray_resources: {decode: 3}\n", [], "decode: want a mapping"),
        ("launcher: kubernetes\n", [], "launcher must be local or ray"),
        ("role_args: {prefill: 3}\n", [], "role_args: prefill: want a string"),
    ):
        cfg.write_text(text)
        assert main(["cluster", "up", "--port", "1", "--config", str(cfg), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and needle in err, err
    assert not started
    from hetserve.entrypoints.cluster import _spec

    cfg.write_text("slo_ttft_ms: 300\nprefill: 2\nrestart: false\n"
                   "role_args: {prefill: --placement device}\n")  # fmt: skip
    args = argparse.Namespace(
        model=None, prefill=1, decode=1, both=0, store="none", store_dram="1G", port=1,
        policy="kvcentric", admission="none", slo_ttft_ms=500.0, slo_tbt_ms=None,
        handoff_path="direct", instance_args="", log_dir="d", log_requests=None,
        config=str(cfg), no_restart=False, host="127.0.0.1", api_key=None, launcher="local",
        ray_address=None, ray_resources=[], role_args=["decode=--dtype float32"],
    )  # fmt: skip
    spec = _spec(args)
    assert spec.slo_ttft_ms == 300 and spec.prefill == 2 and spec.restart is False
    # The file's role_args replace the flags' (as every key does).
    assert spec.role_args == {"prefill": ("--placement", "device")}
