"""GGUF files whose layers mix block types, as people download them: experts stay in each
tensor's own type (never fp32), logprobs within the q4_K tests' bound of the file's exact model
(gguf's dequantized numbers, with the kernels' q8_K activation rounding emulated), and the
loader's one summary line. Files from llama.cpp's own quantizer (Q4_K_M, Q5_K_M) where
llama-cpp-python is installed, and from `gguf` plus our reference quantizers always."""

from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from hetserve import LLM  # noqa: E402
from hetserve.native import native_unavailable_reason  # noqa: E402
from hetserve.quant.gguf_convert import converted, relative_rms  # noqa: E402
from hetserve.testing.ggml_quant import ggml_unavailable_reason  # noqa: E402
from hetserve.testing.tiny_gguf import _write_reference, write_gguf  # noqa: E402

from .test_gguf import BOUND, logprobs, q8k_reference  # noqa: E402

pytestmark = pytest.mark.skipif(
    bool(native_unavailable_reason()), reason="native kernels unavailable"
)
NEEDS_GGML = pytest.mark.skipif(
    bool(ggml_unavailable_reason()), reason=f"llama.cpp's quantizer: {ggml_unavailable_reason()}"
)
# 8 layers: llama.cpp's Q4_K_M gives ffn_down_exps q6_K in some layers only
SHAPE = {"hidden_size": 256, "moe_intermediate_size": 256, "head_dim": 64,
         "num_hidden_layers": 8}  # fmt: skip


def _dequantized_reference(path, src, out) -> None:
    """The file's exact model: every tensor as gguf dequantizes it, as an HF directory."""
    tensors = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        tensors[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
    _write_reference(src, out, {k: np.array(v, np.float32) for k, v in tensors.items()})


def _llama_cpp_file(src, tmp_path, ftype: str):
    """llama.cpp's quantizer's `ftype` file of the tiny model, and its exact model at ref/."""
    import llama_cpp

    f32 = write_gguf(src, tmp_path / "f32.gguf", tmp_path / "ref32", "f32", "f32")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    path = tmp_path / f"{ftype}.gguf"
    rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(path).encode(), ctypes.byref(params))
    assert rc == 0
    _dequantized_reference(path, src, tmp_path / "ref")
    return path


def _expert_kinds(llm: LLM) -> set[tuple[str, str]]:
    kinds = set()
    for _, e in llm.model.routed_experts():
        b = e._backend
        kinds.add(getattr(b, "formats", (e.backend_name, e.backend_name)))
        assert e.backend_name in ("cpu-gguf", "cpu-int4", "cpu-int8")
    return kinds


def test_q6_k_down_beside_q4_k_gate_up(tiny_model, tmp_path, capfd):
    src = tiny_model("qwen3-moe", overrides=SHAPE)
    path = write_gguf(src, tmp_path / "m.gguf", tmp_path / "ref", "q4_K", "q8_0", down="q6_K")
    llm = LLM(str(path), placement="device")
    assert _expert_kinds(llm) == {("int4", "q6_K")}
    line = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("GGUF m.gguf")]
    assert (
        len(line) == 1 and "experts Q6_K kept x8" in line[0] and "experts Q4_K kept x16" in line[0]
    )
    err = (logprobs(llm) - logprobs(q8k_reference(tmp_path / "ref"))).abs()
    assert float(err.max()) <= BOUND


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q5_K_M"])
def test_llama_cpp_k_quant_mixes(tiny_model, tmp_path, ftype):
    pytest.importorskip("llama_cpp", reason="llama.cpp's quantizer not installed")
    src = tiny_model("qwen3-moe", overrides=SHAPE)
    path = _llama_cpp_file(src, tmp_path, ftype)
    llm = LLM(str(path), placement="device")
    # all-q4_K layers keep cpu-int4; the q6_K down layers and every Q5_K_M layer cpu-gguf
    uniform = ("cpu-int4",) * 2 if ftype == "Q4_K_M" else ("q5_K", "q5_K")
    low = "int4" if ftype == "Q4_K_M" else "q5_K"
    assert _expert_kinds(llm) == {(low, "q6_K"), uniform}
    err = (logprobs(llm) - logprobs(q8k_reference(tmp_path / "ref"))).abs()
    # Measured: Q4_K_M max 0.087 / median 7.6e-4, Q5_K_M 0.012 / 2.1e-3 (llama.cpp's pure
    # q4_K file: 2e-6). Traced for Q4_K_M: every layer's experts equal a float64 emulation of
    # their arithmetic to <= 5e-7 on every token but one, token 19 of layer 7, whose gated
    # activation sits 3.5e-6 of a step from a q8_K rounding boundary: the kernel's fp32 sum
    # lands on the other step (7.4e-3 at the layer's output), and later layers carry it on.
    assert float(err.max()) <= 0.1 and float(err.median()) <= 5e-3


def test_types_without_a_kernel_convert_to_no_more_bits_not_fp32(tiny_model, tmp_path, capfd):
    """q5_0 experts (no native kernel): converted at load to q5_K (5.5 bpw, as many bits), the
    error against the file's numbers in the line."""
    src = tiny_model("qwen3-moe", overrides=SHAPE)
    path = write_gguf(src, tmp_path / "m.gguf", tmp_path / "ref", "q4_K", "f32", down="q5_0")
    llm = LLM(str(path), placement="device")
    assert _expert_kinds(llm) == {("int4", "q5_K")}
    err = capfd.readouterr().err
    assert "experts Q5_0 (5.5 bpw) -> q5_K (5.5 bpw; rel rms " in err
    assert "-> fp32" not in err.split("experts", 1)[1]
    # 5 bits rounded again to q5_K's 5 on random weights: measured max 0.33 on logprobs
    # against the file's exact model (the price of the conversion, stated per tensor above)
    assert float((logprobs(llm) - logprobs(q8k_reference(tmp_path / "ref"))).abs().max()) < 1.0


@NEEDS_GGML
def test_llama_cpp_iq4_xs_file_keeps_its_blocks(tiny_model, tmp_path, capfd):
    """llama.cpp's IQ4_XS file (its quantizer, no importance matrix needed): experts served from
    their IQ4_XS blocks as they are, within the q4_K tests' bound of the file's exact model."""
    src = tiny_model("qwen3-moe", overrides=SHAPE)
    path = _llama_cpp_file(src, tmp_path, "IQ4_XS")
    llm = LLM(str(path), placement="device")
    # llama.cpp's IQ4_XS mix gives one ffn_down_exps q5_K (its choice for the first layers)
    assert _expert_kinds(llm) == {("iq4_xs", "iq4_xs"), ("iq4_xs", "q5_K")}
    assert "experts IQ4_XS kept x23; experts Q5_K kept x1" in capfd.readouterr().err
    err = (logprobs(llm) - logprobs(q8k_reference(tmp_path / "ref"))).abs()
    assert float(err.max()) <= 0.1 and float(err.median()) <= 5e-3


def test_q2_k_and_q3_k_experts_are_served_from_their_own_blocks(tiny_model, tmp_path, capfd):
    """A Q2_K / Q3_K-style file (q3_K gate/up, q2_K down, as llama.cpp's low mixes put them side
    by side): both kept as the file stores them (2.625 and 3.4375 bits per weight, no wider
    copy), within the q4_K tests' bound of the file's exact model."""
    src = tiny_model("qwen3-moe", overrides=SHAPE)
    path = write_gguf(src, tmp_path / "m.gguf", tmp_path / "ref", "q3_K", "q8_0", down="q2_K")
    llm = LLM(str(path), placement="device")
    assert _expert_kinds(llm) == {("q3_K", "q2_K")}
    line = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("GGUF m.gguf")]
    assert len(line) == 1 and "experts Q2_K kept x8" in line[0], line
    assert "experts Q3_K kept x16" in line[0] and "->" not in line[0].split("experts", 1)[1]
    err = (logprobs(llm) - logprobs(q8k_reference(tmp_path / "ref"))).abs()
    # Measured: median 1.4e-6, max 0.29. Traced layer by layer (the same file with q2_K for
    # both): every layer's experts equal a float64 emulation of their arithmetic on the
    # inputs they got (<= 5e-7 relative, every token), but one activation of layer 2, token 19
    # sits on a q8_K rounding boundary that the reference's fp32 sums land on the other side
    # of; later layers and tokens carry it on (as for llama.cpp's Q4_K_M file above).
    assert float(err.median()) <= 5e-3 and float(err.max()) <= 0.5


def test_grid_i_quant_experts_are_served_from_their_own_blocks(tiny_model, tmp_path, capfd):
    """IQ2_XXS gate/up beside IQ3_XXS down (Unsloth's dynamic IQ2 files mix them so): both kept
    as the file stores them (2.06 and 3.06 bits per weight, never widened), within the
    flip-aware bound of the file's exact model. Random valid blocks (CI has no llama.cpp
    quantizer): the reference is what gguf dequantizes them to."""
    src = tiny_model("qwen3-moe", overrides={**SHAPE, "num_hidden_layers": 4})
    path = write_gguf(src, tmp_path / "m.gguf", tmp_path / "ref", "random_iq2_xxs", "q8_0",
                      down="random_iq3_xxs")  # fmt: skip
    llm = LLM(str(path), placement="device")
    assert _expert_kinds(llm) == {("iq2_xxs", "iq3_xxs")}
    line = next(ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("GGUF m.gguf"))
    assert "experts IQ2_XXS kept x8; experts IQ3_XXS kept x4" in line, line
    err = (logprobs(llm) - logprobs(q8k_reference(tmp_path / "ref"))).abs()
    assert float(err.median()) <= 5e-3 and float(err.max()) <= 0.5


@NEEDS_GGML
@pytest.mark.parametrize("kind", ["IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_S",
                                  "IQ1_M"])  # fmt: skip
def test_llama_cpp_grid_i_quant_files_keep_their_blocks(tiny_model, tmp_path, capfd, kind):
    """llama.cpp's own blocks of every grid i-quant (its quantizer; IQ2/IQ1 with an all-ones
    importance matrix): kept, served natively, within the flip-aware bound of the file's exact
    model."""
    src = tiny_model("qwen3-moe", overrides={**SHAPE, "num_hidden_layers": 2})
    path = write_gguf(src, tmp_path / "m.gguf", tmp_path / "ref", kind, "f32")
    llm = LLM(str(path), placement="device")
    assert _expert_kinds(llm) == {(kind.lower(), kind.lower())}
    line = next(ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("GGUF m.gguf"))
    assert f"experts {kind} kept x6" in line and "->" not in line.split("experts", 1)[1], line
    err = (logprobs(llm) - logprobs(q8k_reference(tmp_path / "ref"))).abs()
    assert float(err.median()) <= 5e-3 and float(err.max()) <= 0.5


@pytest.mark.parametrize(("to", "most"), [("q2_K", 0.4), ("q3_K", 0.2), ("q4_K", 0.1),
                                          ("q5_K", 0.05), ("q6_K", 0.025)])  # fmt: skip
def test_conversions_to_each_k_quant_state_their_error(to, most):
    """What the loader converts to (quant/gguf_convert.py): rows of the target type whose
    relative RMS against the numbers converted is what the summary line states (measured on
    these normal weights: q2_K 0.33, q3_K 0.16, q4_K 0.08, q5_K 0.039, q6_K 0.019)."""
    w = np.random.default_rng(1).standard_normal((16, 512)).astype(np.float32) * 0.05
    value = converted(w, to)
    assert value.fmt == {"q4_K": "int4"}.get(to, to) and value.shape == (16, 512)  # Q4KRows
    assert 0.5 * most < relative_rms(value.dequantize().numpy(), w) < most


def test_conversion_targets_have_no_more_bits_where_one_exists():
    from hetserve.quant.gguf import BITS
    from hetserve.quant.gguf_convert import NATIVE_BPW, convert_target

    expected = {"Q5_0": "q5_K", "Q5_1": "q5_K", "Q4_0": "q4_K", "Q4_1": "q4_K", "F32": "q8_0",
                "F16": "q8_0", "TQ2_0": "q2_K", "TQ1_0": "q2_K"}  # fmt: skip
    for kind, to in expected.items():
        assert convert_target(BITS[kind], 512) == to
        if BITS[kind] >= 2.625:
            assert NATIVE_BPW[to] <= BITS[kind]
    assert convert_target(BITS["Q5_0"], 96) == "q8_0"  # rows off 256: q8_0 only


def test_each_expert_is_its_own_copy_of_the_file(tmp_path, tiny_model):
    """The reader copies experts one at a time (never a layer's stacked tensor at once) and
    the builder lets gate and up go as it concatenates them: what a layer holds while it is
    laid out (tests/model/test_load_memory.py measures the peak)."""
    from hetserve.model.filler import PackedExpertsBuilder
    from hetserve.model.gguf_file import GgufCheckpoint

    src = tiny_model("qwen3-moe", overrides={**SHAPE, "num_hidden_layers": 1})
    path = write_gguf(src, tmp_path / "m.gguf", tmp_path / "ref", "q8_0", "f32")
    ckpt = GgufCheckpoint(path)
    got = list(ckpt.tensors(lambda name: ".experts." in name))
    assert got
    for _, value, _ in got:  # storage of its own size, not a view into a layer's copy
        assert value.q.untyped_storage().nbytes() == value.q.nbytes
    n = ckpt.hf_config()["num_experts"]
    experts = types.SimpleNamespace(num_experts=n, intermediate_size=SHAPE["moe_intermediate_size"],
                                    hidden_size=SHAPE["hidden_size"])  # fmt: skip
    builder = PackedExpertsBuilder("model.layers.0.mlp.experts", experts)
    halves = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}
    for name, value, _ in got:
        e, proj = name.split(".")[-3:-1]
        pname, half = halves[proj]
        builder.add(pname, int(e), half, value, name)
    packed = builder.build()
    assert not builder.parts and packed.num_experts == n
