"""`hetserve convert`: CPU-format experts on disk, served directly."""

import subprocess
import sys

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.model.convert import convert
from hetserve.quant.converted import dequantize, quantize

IDS = torch.randint(10, 400, (50,), generator=torch.Generator().manual_seed(0)).tolist()


def logprobs(llm) -> torch.Tensor:
    out = llm.generate(
        prompt_token_ids=IDS, sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0)
    )[0]
    return torch.tensor(
        [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], IDS[1:], strict=True)]
    )


@pytest.mark.parametrize("fmt,group", [("int8", 0), ("int4", 32), ("int4", 64)])
def test_quantization_round_trip_is_idempotent(fmt, group):
    w = torch.randn(3, 64, 128)
    stored = quantize(w, fmt, group)
    again = quantize(dequantize(stored, fmt, group), fmt, group)
    for key in stored:
        if key == "q":
            assert torch.equal(stored[key], again[key])
        else:
            torch.testing.assert_close(stored[key], again[key], rtol=1e-6, atol=1e-7)


def test_int8_converted_model_equals_quantizing_at_load(tiny_model, tmp_path):
    src = tiny_model("qwen3-moe", overrides={"moe_intermediate_size": 64})
    out = convert(src, tmp_path / "int8", "int8")
    fp32_experts = sum(
        e.w13.numel() + e.w2.numel() for _, e in LLM(src, placement="device").model.routed_experts()
    )
    assert (out / "experts-int8.safetensors").stat().st_size < fp32_experts * 4 / 3
    served = LLM(out, placement="device")
    assert all(e.w13.numel() == 0 for _, e in served.model.routed_experts())  # originals freed
    assert "cpu-int8" in served.model.hybrid_plan.table()
    assert torch.equal(logprobs(served), logprobs(LLM(src, placement="default")))


def test_int4_converted_model_is_within_int4_error(tiny_model, tmp_path):
    src = tiny_model("deepseek-v3", overrides={"moe_intermediate_size": 64})
    out = convert(src, tmp_path / "int4", "int4", group_size=32)
    served = LLM(out, placement="device")
    assert "cpu-int4" in served.model.hybrid_plan.table()
    err = (logprobs(served) - logprobs(LLM(src, placement="device"))).abs()
    assert 0 < err.max() < 1.5 and err.mean() < 0.25


def test_convert_cli_errors(tiny_model, tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "hetserve.cli", "convert", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )

    dense = str(tiny_model("qwen3"))
    for args in (
        ["--quant", "int8", dense, str(tmp_path / "a")],
        [
            "--quant",
            "int4",
            "--group-size",
            "48",
            str(tiny_model("qwen3-moe")),
            str(tmp_path / "b"),
        ],
    ):
        r = run(*args)
        assert r.returncode == 2 and r.stderr.startswith("error:"), r.stderr
        assert "Traceback" not in r.stderr
