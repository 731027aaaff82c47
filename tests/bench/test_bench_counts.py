"""Counts and sizes of 0 (or below) are refused before a bench loads or times anything."""

from __future__ import annotations

import json

import pytest

from hetserve.cli import main

TINY_KERNEL = ["--hidden", "64", "--inter", "32", "--experts", "4", "--top-k", "2"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["generate", "--model", "{d}", "--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["generate", "--model", "{d}", "--prompt-len", "0"], "--prompt-len must be >= 1"),
        (["throughput", "--model", "{d}", "--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["throughput", "--model", "{d}", "--output-len", "0"], "--output-len must be >= 1"),
        (["throughput", "--model", "{d}", "--hf-batch", "0"], "--hf-batch must be >= 1"),
        (["prefix", "--model", "{d}", "--trials", "0"], "--trials must be >= 1, got 0"),
        (["prefix", "--model", "{d}", "--prompt-len", "0"], "--prompt-len must be >= 1"),
        (["decode", "--model", "{d}", "--threads", "-1"], "--threads must be >= 1, got -1"),
        (["decode", "--model", "{d}", "--bandwidth-mib", "0"], "--bandwidth-mib must be >= 1"),
        (["decode", "--model", "{d}", "--streams", ""], "--streams must be positive integers"),
        (["deferral", "--model", "{d}", "--threads", "-1"], "--threads must be >= 1"),
        (["moe-kernel", *TINY_KERNEL, "--iters", "0"], "--iters must be >= 1, got 0"),
        (["moe-kernel", *TINY_KERNEL, "--threads", "0"], "--threads must be >= 1"),
        (["moe-kernel", *TINY_KERNEL, "--bandwidth-mib", "0"], "--bandwidth-mib must be >= 1"),
        (["moe-kernel", *TINY_KERNEL, "--backends", ""], "--backends names no backend"),
        (["conductor", "--block-size", "0"], "--block-size must be >= 1, got 0"),
        (["handoff", "--links", "0"], "--links must be >= 1, got 0"),
        (["store", "--sizes", "4K,0", "--no-mooncake"], "--sizes: a value is at least 1 byte"),
        (["store", "--total", "0", "--no-mooncake"], "--total: bytes moved per size"),
        (["finetune", "--model", "{d}", "--plot", "{d}"], ": is a directory; give a file"),
        (["serve", "--base-url", "http://127.0.0.1:9", "--model", "{d}", "--request-timeout", "0"],
         "--request-timeout must be > 0"),
        (["prefill", "--model", "{d}", "--bandwidth-mib", "0"], "--bandwidth-mib must be >= 1"),
        (["prefill", "--model", "{d}", "--prompt-lens", ""], "give one or more positive lengths"),
    ],
)
def test_a_count_of_zero_is_one_line_before_the_work(tmp_path, capsys, argv, needle):
    """Each ran: a 0 tok/s row with exit 0 (generate --repeats 0, throughput --num-prompts 0),
    a traceback (an empty median, a division by zero, set_num_threads(-1), range step 0), or
    a silent 1 for a 0 (throughput's lengths); the model's files were read first. A value size
    of 0 in bench store divided by zero; prefill's read peak was 0.0 GB/s, and its empty
    --prompt-lens ran the defaults (then 8192 tokens did not fit a model it never named)."""
    config = {"vocab_size": 32, "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))  # no weights: none is read
    argv = ["bench", *(a.replace("{d}", str(tmp_path)) for a in argv)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err, err
