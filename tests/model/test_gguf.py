"""`--model file.gguf`: GGUF files as llama.cpp writes them (testing/tiny_gguf.py), against the
fp32 model the `gguf` package reads from the same file; experts served from their q4_K / q8_0
numbers exactly; config and tokenizer from the metadata when nothing is beside the file."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from hetserve import LLM, SamplingParams  # noqa: E402
from hetserve.errors import ModelLoadError, UnsupportedArchitectureError  # noqa: E402
from hetserve.model.tokenizer import Tokenizer  # noqa: E402
from hetserve.moe.experts import gated_activation  # noqa: E402
from hetserve.native import native_unavailable_reason  # noqa: E402
from hetserve.quant.gguf import q4_k_rows, q8_0_rows  # noqa: E402
from hetserve.quant.quantize import q8k_round  # noqa: E402
from hetserve.testing.tiny_gguf import quantize_q4_k, write_gguf  # noqa: E402

# q4_K needs rows of 256: a Qwen3-MoE just big enough.
SHAPE = {"hidden_size": 256, "moe_intermediate_size": 256, "head_dim": 64}
IDS = torch.randint(10, 400, (40,), generator=torch.Generator().manual_seed(0)).tolist()
# |logprob(GGUF) - logprob(reference)| over 40 positions: the experts' q4_K / q8_0 numbers are
# kept exactly; left is q8_0's int16 activation rounding, and for q4_K flips of the int8 one
# (llama.cpp's q8_K, which the reference applies too: on these random weights it alone moves
# logprobs by up to ~0.6).
BOUND = 2e-3


class _Q8KExperts:
    """The torch reference experts with the q4_K kernel's activation rounding (x, and the gated
    activation times the router weight), pair by pair."""

    def __init__(self, experts) -> None:
        self.w13, self.w2 = experts.w13.detach(), experts.w2.detach()
        self.inter, self.glu = experts.intermediate_size, gated_activation(experts.activation)

    def forward(self, x, topk_weights, topk_ids):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            xt = q8k_round(x[t])
            for j in range(topk_ids.shape[1]):
                i, w = int(topk_ids[t, j]), topk_weights[t, j]
                gate, up = (self.w13[i] @ xt).split(self.inter)
                out[t] += self.w2[i] @ q8k_round(self.glu(gate, up) * w)
        return out


def q8k_reference(ref, linears: tuple[str, ...] = ()) -> LLM:
    """gguf's fp32 model with the q4_K kernel's activation rounding: in the routed experts, and
    at the inputs of the named linears (those stored as q4_K)."""
    llm = LLM(ref, placement="device")
    for _, e in llm.model.routed_experts():
        e._backend = _Q8KExperts(e)
    modules = dict(llm.model.named_modules())
    for name in linears:  # the placed model fuses q/k/v, the reference keeps them apart
        parts = [name] if name in modules else [name.replace("qkv", p) for p in "qkv"]
        for part in parts:
            modules[part].register_forward_pre_hook(lambda _m, a: (q8k_round(a[0]), *a[1:]))
    return llm


@pytest.fixture(scope="module")
def gguf_model(tiny_model, tmp_path_factory):
    made = {}

    def make(experts: str, others: str = "f32"):
        if (experts, others) not in made:
            root = tmp_path_factory.mktemp(f"gguf-{experts}-{others}")
            (root / "alone").mkdir()
            src = tiny_model("qwen3-moe", overrides=SHAPE)
            path = write_gguf(src, root / "alone" / "model.gguf", root / "ref", experts, others)
            made[experts, others] = (path, root / "ref", src)
        return made[experts, others]

    return make


def logprobs(llm: LLM) -> torch.Tensor:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = llm.generate(prompt_token_ids=IDS, sampling_params=params)[0]
    return torch.tensor(
        [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], IDS[1:], strict=True)]
    )


@pytest.mark.parametrize(("experts", "backend"), [("q4_K", "cpu-int4"), ("q8_0", "cpu-int8")])
def test_gguf_experts_served_from_their_own_numbers(gguf_model, experts, backend):
    path, ref, _ = gguf_model(experts)
    llm = LLM(str(path), placement="device")
    for _, e in llm.model.routed_experts():
        assert e.backend_name == backend and e._backend.group_size == 32
    err = (
        logprobs(llm)
        - logprobs(q8k_reference(ref) if experts == "q4_K" else LLM(ref, placement="device"))
    ).abs()
    assert float(err.max()) <= BOUND
    hybrid = LLM(str(path), placement="default")
    assert backend in hybrid.model.hybrid_plan.table()


def test_gguf_with_quantized_dense_weights_and_a_config_beside(gguf_model, tmp_path):
    path, ref, src = gguf_model("q4_K", "q8_0")
    err = (logprobs(LLM(str(path), placement="device")) - logprobs(q8k_reference(ref))).abs()
    assert float(err.max()) <= BOUND
    beside = tmp_path / "model.gguf"
    shutil.copy2(path, beside)
    shutil.copy2(src / "config.json", tmp_path / "config.json")
    torch.testing.assert_close(
        logprobs(LLM(str(beside), placement="device")), logprobs(LLM(str(path), placement="device"))
    )


@pytest.mark.parametrize(("others", "fmt", "group"), [("q4_K", 5, 0), ("q8_0", 1, 32)])
@pytest.mark.skipif(bool(native_unavailable_reason()), reason="native kernels unavailable")
def test_gguf_dense_linears_keep_their_numbers_on_cpu_int8(gguf_model, others, fmt, group):
    """CPU-only serving with `cpu-int8` on the non-expert units: linears stored as q8_0 / q4_K
    in the file run on those numbers (no second rounding to int8): within the same bound of
    gguf's fp32 model as the experts, and the q4_K ones stream 9/16 of a byte per weight."""
    from hetserve.bench.decode import _all_int8_rules
    from hetserve.layers.int8_linear import Int8Linear

    path, ref, _ = gguf_model("q4_K", others)
    llm = LLM(str(path), placement=_all_int8_rules("cpu-int4"))
    lins = [m for m in llm.model.modules() if isinstance(m, Int8Linear)]
    # every linear of the tiny model fits the kernel and is stored in `others` in the file
    assert lins and all(m.kernel == "native" and m.fmt == fmt for m in lins)
    assert all(m.group == group for m in lins)
    assert not any(hasattr(m, "packed_weight") for m in llm.model.modules())  # none left over
    if fmt == 5:
        assert all(m.nbytes * 16 == m.in_features * m.out_features * 9 for m in lins)
    names = tuple(n for n, m in llm.model.named_modules() if isinstance(m, Int8Linear))
    err = (logprobs(llm) - logprobs(q8k_reference(ref, names if fmt == 5 else ()))).abs()
    # Every linear rounds its input here (int16 for q8_0, int8 for q4_K): where that, or the
    # reference's fp32 sums, puts an expert's or a q4_K linear's input on the other side of an
    # int8 rounding boundary, it moves by a whole step (1/127 of its block's max). Without the
    # emulated rounding in the reference the error is ~0.6.
    assert float(err.max()) <= 3e-2


def test_q4_k_and_q8_0_read_exactly_as_gguf_reads_them():
    g = np.random.default_rng(0)
    w = g.standard_normal((6, 512)).astype(np.float32) * 0.1
    w[1, :40] = 0.0  # an all-zero sub-block
    w[2] = np.abs(w[2])  # minimum above zero: clamped to 0 as llama.cpp does
    raw = quantize_q4_k(w)
    assert raw.shape == (6, 2 * 144)
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    assert np.array_equal(q4_k_rows(raw).dequantize().numpy(), theirs)
    assert np.abs(theirs - w).max() < 0.02
    raw8 = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    theirs8 = gguf.quants.dequantize(raw8, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(q8_0_rows(raw8).dequantize().numpy(), theirs8)


def test_tokenizer_from_the_gguf_metadata(gguf_model):
    path, _, src = gguf_model("q4_K")
    ours, original = Tokenizer(path), Tokenizer(src)
    text = "hello world, how are you today? <|im_start|>user\n42 experts<|im_end|>"
    assert ours.encode(text) == original.encode(text)
    assert ours.decode(original.encode(text)) == original.decode(original.encode(text))
    assert ours.eos_token_ids == original.eos_token_ids


def test_gguf_errors_are_one_line(tmp_path):
    bad = tmp_path / "bloom.gguf"
    writer = gguf.GGUFWriter(str(bad), "bloom")
    writer.add_block_count(1)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):  # fmt: skip
        step()
    with pytest.raises(UnsupportedArchitectureError, match="'bloom'.*qwen3moe"):
        LLM(str(bad))
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "missing.gguf"))
    empty = tmp_path / "empty.gguf"
    writer = gguf.GGUFWriter(str(empty), "qwen3moe")
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):  # fmt: skip
        step()
    with pytest.raises(ModelLoadError) as exc:
        LLM(str(empty))
    assert "hidden_size" in str(exc.value) and "\n" not in str(exc.value)
