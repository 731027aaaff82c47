"""Routed experts of a dense checkpoint that only the native cpu-int8 backend serves (the
all-int8 placement on a CPU) are rounded to int8 as each tensor is read (model/build.py,
`_int8_on_arrival`), and so are the linears that become native Int8Linears
(`_linear_rounding`): neither ever exists in full precision. The served model is the one the
backends made from the dense weights, bit for bit, for per-expert tensors (Qwen3-MoE), fused
ones with biases and gpt-oss's clamped SwiGLU, sizes off every kernel unit (padding after
rounding), bf16 checkpoints, and linear attention's projections kept precise (Qwen3-Next);
placements that keep dense weights load them dense."""

from __future__ import annotations

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.model import build
from hetserve.native import native_unavailable_reason
from hetserve.quant.packed import Int8Rows
from tests.model.test_odd_sizes import ODD

pytestmark = pytest.mark.skipif(
    bool(native_unavailable_reason()), reason="native kernels unavailable"
)

PROMPTS = [list(range(10, 31)), list(range(40, 45))]
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5,
                        prompt_logprobs=0)  # fmt: skip


def _run(path: str, **kwargs) -> list:
    llm = LLM(path, **kwargs)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)
    return [
        (o.outputs[0].token_ids,
         [{t: v.logprob for t, v in (e or {}).items()} for e in o.prompt_logprobs],
         [{t: v.logprob for t, v in step.items()} for step in o.outputs[0].logprobs])
        for o in outs
    ]  # fmt: skip


class _Count:
    def __init__(self, monkeypatch) -> None:
        self.n = 0
        real = Int8Rows.per_row

        def counted(w):
            self.n += 1
            return real(w)

        monkeypatch.setattr(Int8Rows, "per_row", staticmethod(counted))


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("qwen3-moe", {}),
        ("qwen3-moe", ODD),
        ("gpt-oss", {}),
        ("qwen3-moe", {"dtype": "bfloat16"}),
        ("qwen3-next", {}),
    ],
    ids=["per-expert", "odd-sizes", "fused-with-biases", "bf16", "precise-projections"],
)
def test_experts_rounded_as_read_serve_the_same_bits(tiny_model, monkeypatch, family, overrides):
    path = str(tiny_model(family, overrides=overrides))
    count = _Count(monkeypatch)
    early = _run(path)
    assert count.n > 0  # the experts and linears were rounded as they were read
    monkeypatch.setattr(build, "_int8_on_arrival", lambda plan, name: None)
    monkeypatch.setattr(build, "_linear_rounding", lambda: None)
    count.n = 0
    late = _run(path)  # dense weights loaded, the backends round them
    assert count.n == 0
    assert early == late


def test_placements_that_keep_dense_experts_load_them_dense(tiny_model, monkeypatch):
    count = _Count(monkeypatch)
    llm = LLM(str(tiny_model("qwen3-moe")), placement="device")
    assert count.n == 0
    experts = next(m for _, m in llm.model.routed_experts())
    assert experts.w13.numel() > 0 and experts.w13.dtype == torch.float32


def test_a_tied_lm_head_stored_anyway_is_served_from_the_embeddings(
    tiny_model, monkeypatch, tmp_path
):
    """A config that ties the LM head to the embeddings while the file still stores an
    lm_head.weight: the embeddings serve it, rounded as read or not (tie_weights replaces it)."""
    import json
    import shutil

    path = tmp_path / "m"
    shutil.copytree(tiny_model("qwen3-moe"), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    early = _run(str(path))
    monkeypatch.setattr(build, "_int8_on_arrival", lambda plan, name: None)
    monkeypatch.setattr(build, "_linear_rounding", lambda: None)
    assert _run(str(path)) == early
