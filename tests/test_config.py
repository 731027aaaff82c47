"""One config path: engine options are declared once and reach every entry point the same way."""

import argparse
import subprocess
import sys

import pytest

from hetserve.cli import build_parser
from hetserve.config import ENGINE_OPTIONS, EngineConfig, add_engine_args
from hetserve.errors import InvalidInputError

FLAGGED = [o for o in ENGINE_OPTIONS if o.flag != ""]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(argv)


def test_flags_and_keywords_build_the_same_config():
    argv = [
        "--model", "/m", "--dtype", "float32", "--max-model-len", "512", "--block-size", "32",
        "--num-kv-blocks", "99", "--kv-cache-gb", "0.5", "--no-prefix-caching",
        "--max-num-seqs", "3", "--max-num-batched-tokens", "77", "--scheduling-policy",
        "priority", "--placement", "default", "--gpu-experts", "2", "--routing-stats", "s.json",
        "--cpu-threads", "5", "--max-deferred-experts-per-token", "1", "--max-step-ms", "40",
        "--slo-tbt-ms", "60",
    ]  # fmt: skip
    from_flags = EngineConfig.from_args(parse(argv))
    from_kw = EngineConfig.from_options(
        model="/m", dtype="float32", max_model_len=512, block_size=32, num_kv_blocks=99,
        kv_cache_gb=0.5, enable_prefix_caching=False, max_num_seqs=3, max_num_batched_tokens=77,
        scheduling_policy="priority", placement="default", gpu_experts=2,
        routing_stats="s.json", cpu_threads=5, max_deferred_experts_per_token=1,
        max_step_ms=40.0, slo_tbt_ms=60.0,
    )  # fmt: skip
    assert from_flags == from_kw
    assert from_kw.cache.kv_cache_bytes == 1 << 29 and from_kw.scheduler.policy.value == "priority"
    assert from_kw.moe.gpu_experts == 2 and not from_kw.cache.enable_prefix_caching


def test_defaults_come_from_the_dataclasses():
    assert EngineConfig.from_args(parse([])) == EngineConfig() == EngineConfig.from_options()


def test_unknown_keyword_names_the_closest_option():
    with pytest.raises(TypeError, match="did you mean 'num_kv_blocks'"):
        EngineConfig.from_options(num_kv_block=3)


def test_bad_value_is_an_input_error_naming_it():
    with pytest.raises(InvalidInputError, match="^--block-size must be a power of two"):
        EngineConfig.from_args(parse(["--block-size", "3"]))  # the flag, on the command line
    with pytest.raises(InvalidInputError, match="^block_size must be a power of two"):
        EngineConfig.from_options(model="m", block_size=3)  # the keyword, from Python


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-step-ms", "0"], "--max-step-ms must be > 0"),
        (["--slo-tbt-ms", "-5"], "--slo-tbt-ms must be > 0"),
        (["--slo-tbt-ms", "nan"], "--slo-tbt-ms must be > 0"),
        (["--max-step-ms", "80", "--slo-tbt-ms", "50"], "must not exceed slo_tbt_ms"),
    ],
)
def test_step_limits_are_checked(argv, message):
    with pytest.raises(InvalidInputError, match=message):
        EngineConfig.from_args(parse(argv))
    inf = EngineConfig.from_args(parse(["--max-step-ms", "inf"]))  # chunks by tokens alone
    assert inf.scheduler.max_step_ms == float("inf")


@pytest.mark.parametrize("command", ["serve", "generate", "chat", "calibrate"])
def test_every_engine_command_takes_every_engine_flag(command):
    sub = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices[command]
    flags = {s for a in sub._actions for s in a.option_strings}
    assert {o.cli_flag for o in FLAGGED} <= flags


def test_cli_bad_engine_flag_is_one_line_exit_2():
    r = subprocess.run(
        [sys.executable, "-m", "hetserve.cli", "generate", "--block-size", "3", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == ["error: --block-size must be a power of two, got 3"]


def test_engine_never_imports_the_server():
    code = "import sys, hetserve.engine.async_llm, hetserve.engine.llm, "
    code += "hetserve.entrypoints.generate; "
    code += "print([m for m in sys.modules if m.startswith('hetserve.server')])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "[]", r.stderr


@pytest.mark.parametrize(
    ("options", "message"),
    [
        # Found in a trial: LLM(model, max_model_len="512") failed with "'<' not supported
        # between instances of 'str' and 'int'", 512.0 with "'float' object cannot be
        # interpreted as an integer", and enable_prefix_caching="no" turned the cache on.
        ({"max_model_len": "512"}, "'max_model_len' takes an int, got '512'"),
        ({"max_model_len": 512.0}, "'max_model_len' takes an int"),
        ({"block_size": True}, "'block_size' takes an int"),
        ({"session_ttl": "x"}, "'session_ttl' takes a number"),
        ({"kv_cache_gb": "abc"}, "'kv_cache_gb' takes a number"),
        ({"enable_prefix_caching": "no"}, "'enable_prefix_caching' takes True or False"),
        ({"enable_lora": 1}, "'enable_lora' takes True or False"),
    ],
)
def test_keyword_of_the_wrong_type_is_a_type_error_naming_it(options, message):
    with pytest.raises(TypeError, match=message):
        EngineConfig.from_options(**options)


def test_keywords_of_the_right_type_pass():
    cfg = EngineConfig.from_options(kv_cache_gb=1, max_step_ms=float("inf"), max_model_len=None)
    assert cfg.cache.kv_cache_bytes == 1 << 30


def test_help_shows_enum_defaults_as_they_are_typed():
    """`serve --help` printed 'default: KVLoad.AUTO', 'SchedulingPolicy.FCFS', 'Role.BOTH'."""
    import argparse

    from hetserve.config import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    text = parser.format_help()
    assert "(default: fcfs)" in text and "(default: both)" in text
    assert "KVLoad." not in text and "SchedulingPolicy." not in text and "Role." not in text
