"""deepseek2 (DeepSeek-V2/V3, MLA with shared experts) and glm4moe GGUF files as llama.cpp's
own converter writes them: the split attn_k_b / attn_v_b tensors fused back into kv_b_proj (and
the older fused attn_kv_b), the config from llama.cpp's metadata keys. Logprobs against the
fp32 checkpoint the file was converted from (its q8_0 rounding included), and no further from
it than llama.cpp itself."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from hetserve import LLM, envs  # noqa: E402
from hetserve.model.gguf_archs import fuse_kv_b  # noqa: E402

from .test_gguf import IDS, logprobs  # noqa: E402

SHAPE = {"hidden_size": 256, "moe_intermediate_size": 256, "q_lora_rank": 64}
MIXTRAL = {"hidden_size": 256, "intermediate_size": 256, "head_dim": 64}


@pytest.mark.parametrize("experts", ["q8_0", "q4_K", "IQ4_XS"])
def test_mixtral_as_llama_with_experts(tiny_model, tmp_path, experts):
    """Mixtral is `llama` with expert_count to llama.cpp, its q / k rows reordered for the
    interleaved rotary: against transformers on the file's exact numbers (q4_K / IQ4_XS with the
    kernels' q8_K activation rounding emulated), within the q4_K tests' bound."""
    from hetserve.testing.ggml_quant import ggml_unavailable_reason
    from hetserve.testing.tiny_gguf import write_gguf

    from .test_gguf import BOUND, q8k_reference

    if experts == "IQ4_XS" and ggml_unavailable_reason():
        pytest.skip(f"llama.cpp's quantizer: {ggml_unavailable_reason()}")
    src = tiny_model("mixtral", overrides=MIXTRAL)
    path = write_gguf(src, tmp_path / "m.gguf", tmp_path / "ref", experts, "f32")
    llm = LLM(str(path), placement="device")
    assert llm.model.config.architecture == "MixtralForCausalLM"
    assert {e.backend_name for _, e in llm.model.routed_experts()} == {{
        "q8_0": "cpu-int8", "q4_K": "cpu-int4", "IQ4_XS": "cpu-gguf"}[experts]}  # fmt: skip
    ours = logprobs(llm)
    if experts == "q8_0":  # the file's numbers in transformers itself
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref"), dtype=torch.float32)
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([IDS])).logits[0].float(), -1)
        ref = torch.tensor([float(lp[i, IDS[i + 1]]) for i in range(len(IDS) - 1)])
    else:
        ref = logprobs(q8k_reference(tmp_path / "ref"))
    # measured: q8_0 2.0e-4 (its int16 activation rounding), q4_K and IQ4_XS 1e-6
    assert float((ours - ref).abs().max()) <= BOUND


def test_split_kv_b_fuses_back_as_the_converter_split_it():
    """convert_hf_to_gguf: kv_b [heads * (nope + v), rank] viewed per head, split into k_b
    (transposed) and v_b."""
    heads, nope, v, rank = 4, 16, 8, 32
    kv_b = torch.randn(heads * (nope + v), rank)
    k_b, v_b = torch.split(kv_b.view(heads, nope + v, rank), [nope, v], dim=1)
    assert torch.equal(fuse_kv_b(k_b.transpose(1, 2), v_b), kv_b)


FAMILIES = {  # family: (overrides, architecture)
    "deepseek-v2": (SHAPE, "DeepseekV2ForCausalLM"),
    "glm4-moe": ({"hidden_size": 256, "moe_intermediate_size": 256}, "Glm4MoeForCausalLM"),
    "mixtral": (MIXTRAL, "MixtralForCausalLM"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_from_llama_cpp_converter(tiny_model, tmp_path, family):
    from hetserve.bench.decode_llamacpp import convert, find_converter

    src = find_converter(envs.llama_cpp_src())
    if src is None:
        pytest.skip(f"llama.cpp's converter not found (set {envs.LLAMA_CPP_SRC})")
    overrides, arch = FAMILIES[family]
    ckpt = tiny_model(family, overrides=overrides)
    (tmp_path / "alone").mkdir()
    path = convert(ckpt, tmp_path / "alone" / "m.gguf", src, "q8_0")
    llm = LLM(str(path))  # nothing beside it: config and tokenizer from the metadata
    assert llm.model.config.architecture == arch
    # the file's q8_0 experts on the int8 kernel (Mixtral's plan gives it per phase: "placed")
    assert {type(e._backend).__name__ for _, e in llm.model.routed_experts()} == {
        "NativeInt8Experts"
    }
    fp32 = logprobs(LLM(str(ckpt)))
    err = (logprobs(llm) - fp32).abs()
    # q8_0 rounding of every weight, measured: deepseek-v2 max 0.037 / median 0.010; glm4-moe
    # 0.49 / 0.010 (one position's routing moves; llama.cpp on the file: 0.475 there)
    assert float(err.median()) <= 0.03 and float(err.max()) <= 0.6
    try:
        import llama_cpp
    except ImportError:
        return
    peer = llama_cpp.Llama(str(path), logits_all=True, n_ctx=128, verbose=False, n_threads=2)
    peer.eval(IDS)
    lp = torch.log_softmax(torch.tensor(np.array(peer.scores[: len(IDS)])), -1)
    theirs = (torch.tensor([float(lp[i, IDS[i + 1]]) for i in range(len(IDS) - 1)]) - fp32).abs()
    # no further from the fp32 model than llama.cpp on the same file (its median: 0.016-0.017)
    assert float(err.median()) <= float(theirs.median()) + 1e-3
    assert float(err.max()) <= float(theirs.max()) + 0.05
    shutil.rmtree(tmp_path / "alone")


def _with_fused_kv_b(path, out) -> None:
    """The same file in the older layout: attn_kv_b (f32) instead of attn_k_b / attn_v_b."""
    import gguf

    from hetserve.model.gguf_file import GgufCheckpoint

    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(out), "deepseek2")
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), vtype, sub_type=sub)
    ckpt = GgufCheckpoint(path)
    for t in reader.tensors:
        if "attn_v_b" in t.name:
            continue
        if "attn_k_b" in t.name:
            layer = t.name.split(".")[1]
            fused = [v for n, v, _ in ckpt._kv_b(t.name, lambda _: True)][0]
            writer.add_tensor(f"blk.{layer}.attn_kv_b.weight", fused.numpy())
            continue
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_deepseek2_fused_kv_b_layout(tiny_model, tmp_path):
    from hetserve.bench.decode_llamacpp import convert, find_converter

    src = find_converter(envs.llama_cpp_src())
    if src is None:
        pytest.skip(f"llama.cpp's converter not found (set {envs.LLAMA_CPP_SRC})")
    ckpt = tiny_model("deepseek-v2", overrides=SHAPE)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    split = convert(ckpt, tmp_path / "a" / "m.gguf", src, "q8_0")
    _with_fused_kv_b(split, tmp_path / "b" / "m.gguf")
    import gguf

    names = {t.name for t in gguf.GGUFReader(str(tmp_path / "b" / "m.gguf")).tensors}
    assert "blk.1.attn_kv_b.weight" in names and not any("attn_k_b" in n for n in names)
    torch.testing.assert_close(
        logprobs(LLM(str(tmp_path / "b" / "m.gguf"))), logprobs(LLM(str(split)))
    )
