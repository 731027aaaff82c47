"""deepseek2 (DeepSeek-V2/V3, MLA with shared experts) and glm4moe GGUF files as llama.cpp's
own converter writes them: the split attn_k_b / attn_v_b tensors fused back into kv_b_proj (and
the older fused attn_kv_b), the config from llama.cpp's metadata keys. Logprobs against the
fp32 checkpoint the file was converted from (its q8_0 rounding included), and no further from
it than llama.cpp itself."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

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


# gpt-oss, Qwen3-Next, Qwen3.5-MoE, MiniMax-M2, DeepSeek-V3.2 and Kimi-Linear files. llama.cpp fixes
# gpt-oss's clamped SwiGLU at limit 7.0 (the file does not say), so the tiny checkpoint takes
# the published value.
# DeepSeek-V3 (deepseek2) is here for its YaRN rotary, which the file's rope.scaling.* carry.
LATER = {"gpt-oss": {"swiglu_limit": 7.0}, "qwen3-next": {}, "qwen3.5-moe": {}, "minimax-m2": {},
         "deepseek-v3.2": {}, "deepseek-v3": {}, "kimi-linear": {}}  # fmt: skip
LATER_CASES = [("gpt-oss", None), ("gpt-oss", "mxfp4"), ("qwen3-next", None),
               ("qwen3.5-moe", None), ("minimax-m2", None), ("deepseek-v3.2", None),
               ("deepseek-v3", None), ("kimi-linear", None)]  # fmt: skip


_KEPT_F32 = ("mlp.gate.weight", "router.weight", "weights_proj.weight")  # routers stay f32


def _on_file_grid(src, out, mxfp4: bool):
    """`src` with every matrix a q8_0 file holds rounded to q8_0 (gpt-oss's experts, where
    `mxfp4`, to MXFP4 instead): the exact model of the file written from it."""
    from safetensors.torch import load_file, save_file

    from hetserve.quant.packed import Int8Rows
    from hetserve.quant.quantize import dequantize_mxfp4, quantize_mxfp4

    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    tok = json.loads((out / "tokenizer_config.json").read_text())
    if cfg["model_type"] == "deepseek_v32":  # as published (llama.cpp's converter asserts it)
        tok["add_bos_token"] = True
        (out / "tokenizer_config.json").write_text(json.dumps(tok))
    sd = load_file(str(out / "model.safetensors"))
    for name, w in sd.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out]
            rows = w.transpose(1, 2)
            if mxfp4:
                exact = dequantize_mxfp4(*quantize_mxfp4(rows))
            else:
                exact = Int8Rows.q8_0(rows.reshape(-1, rows.shape[-1])).dequantize()
            sd[name] = exact.reshape(rows.shape).transpose(1, 2).contiguous()
        elif name.endswith("kv_b_proj.weight"):  # stored split: k_b (rows of 16: f16), v_b
            heads, nope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
            per = w.view(heads, -1, w.shape[-1]).clone()
            per[:, :nope] = per[:, :nope].half().float()
            per[:, nope:] = Int8Rows.q8_0(per[:, nope:].reshape(-1, w.shape[-1])).dequantize(
            ).reshape(per[:, nope:].shape)  # fmt: skip
            sd[name] = per.reshape(w.shape).contiguous()
        elif w.ndim == 2 and w.shape[0] > 1 and not name.endswith(_KEPT_F32):
            # Qwen3.5's out_proj columns are stored in tiled value-head order: its q8_0 blocks
            # are taken in that order (value heads of 16 columns here, half a block)
            order = _tiled_columns(cfg, w.shape[1]) if name.endswith("out_proj.weight") else None
            if order is not None:
                w = w[:, order]
            if w.shape[1] % 32:  # rows that are no whole q8_0 blocks: the converter's f16
                w = w.half().float()
            else:
                w = Int8Rows.q8_0(w).dequantize().reshape(w.shape)
            sd[name] = (w[:, torch.argsort(order)] if order is not None else w).contiguous()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _tiled_columns(cfg: dict, n: int) -> torch.Tensor | None:
    """Qwen3.5's value heads (grouped by key head in HF) in the converter's tiled order: the
    column index of each stored column (None where the file keeps HF's order)."""
    nk, nv = cfg.get("linear_num_key_heads"), cfg.get("linear_num_value_heads")
    if not cfg["model_type"].startswith("qwen3_5") or nk == nv:
        return None
    grouped = torch.arange(n).reshape(nk, nv // nk, n // nv)
    return grouped.transpose(0, 1).reshape(n)


def _transformers_logprobs(path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([IDS])).logits[0].float(), -1)
    return torch.tensor([float(lp[i, IDS[i + 1]]) for i in range(len(IDS) - 1)])


@pytest.mark.parametrize(("family", "experts"), LATER_CASES)
def test_later_families_from_gguf_against_transformers(tiny_model, tmp_path, family, experts):
    """A q8_0 file (gpt-oss also with its MXFP4 experts) in llama.cpp's layout, nothing beside
    it: the converter's transforms undone (interleaved gate/up, zero-centred norms, -exp(A_log),
    the split in_proj_qkvz, Qwen3.5's tiled value heads), experts on their kernels as stored;
    logprobs equal transformers on the file's exact numbers to the kernels' activation rounding
    (measured 1.2e-4 MiniMax-M2, 1.6e-4 gpt-oss, 3.5-3.9e-4 Qwen3-Next / 3.5)."""
    from hetserve.testing.tiny_gguf_archs import write_family_gguf

    ref = _on_file_grid(tiny_model(family, overrides=LATER[family]), tmp_path / "ref",
                        experts == "mxfp4")  # fmt: skip
    (tmp_path / "alone").mkdir()
    path = write_family_gguf(ref, tmp_path / "alone" / "m.gguf", "q8_0", experts)
    llm = LLM(str(path), placement="device")
    want = "cpu-mxfp4" if experts == "mxfp4" else "cpu-int8"
    assert {e.backend_name for _, e in llm.model.routed_experts()} == {want}
    err = (logprobs(llm) - _transformers_logprobs(ref)).abs()
    assert float(err.max()) <= 1e-3


def _rewritten(path, out, fields=None, extra=None, tensor=None):
    """The GGUF file `path` written again to `out` with the `gguf` package: `fields(key,
    value)` -> the value to write (None: the same), `extra(writer)` adds keys and tensors,
    `tensor(name, array)` -> the array to write."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = f.contents()
        value = (fields(key, value) if fields else None) or value
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        data = np.array(t.data)
        writer.add_tensor(t.name, tensor(t.name, data) if tensor else data, raw_dtype=t.tensor_type)
    if extra:
        extra(writer, reader)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_mtp_layers_after_the_model_are_left_out(tiny_model, tmp_path):
    """Files from published Qwen3-Next / Qwen3.5 / GLM-4.5 checkpoints carry their MTP layers
    as extra blocks (block_count n + k, nextn_predict_layers k): the model is the first n."""
    from hetserve.testing.tiny_gguf_archs import write_family_gguf

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = write_family_gguf(tiny_model("qwen3-next"), tmp_path / "a" / "m.gguf", "f32")
    n = 4  # the tiny model's layers; the last is a full-attention layer

    def fields(key, value):
        if key == "qwen3next.attention.recurrent_layers":
            return [*value, False]
        return n + 1 if key == "qwen3next.block_count" else None

    def extra(writer, reader):
        writer.add_uint32("qwen3next.nextn_predict_layers", 1)
        for t in reader.tensors:  # the MTP block: a copy of the last layer's tensors
            if t.name.startswith(f"blk.{n - 1}."):
                mtp = t.name.replace(f"blk.{n - 1}.", f"blk.{n}.")
                writer.add_tensor(mtp, np.array(t.data), raw_dtype=t.tensor_type)
        writer.add_tensor(f"blk.{n}.nextn.eh_proj.weight", np.zeros((64, 128), np.float32))

    llm = LLM(str(_rewritten(plain, tmp_path / "b" / "m.gguf", fields, extra)))
    assert llm.model.config.num_layers == n
    torch.testing.assert_close(logprobs(llm), logprobs(LLM(str(plain))))


@pytest.mark.parametrize("family", ["qwen3-next", "kimi-linear"])
def test_unit_dimensions_dropped_as_llama_cpp_writes_them(tiny_model, tmp_path, family):
    """llama.cpp's own writer (llama-quantize, so every Q4_K_M file) stores a tensor with only
    the dimensions before its trailing units (ggml_n_dims): the shared-expert gate [1, H] as
    [H], Kimi-Linear's ssm_a [1, 1, heads, 1] as [heads, 1], its convs [1, d, 1, k] as
    [d, 1, k]. Such a file serves the same model."""
    from hetserve.testing.tiny_gguf_archs import write_family_gguf

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = write_family_gguf(tiny_model(family), tmp_path / "a" / "m.gguf", "f32")

    def squeezed(name, data):
        while data.ndim > 1 and data.shape[0] == 1:  # numpy's leading = ggml's trailing dims
            data = data[0]
        return data

    llm = LLM(str(_rewritten(plain, tmp_path / "b" / "m.gguf", tensor=squeezed)))
    torch.testing.assert_close(logprobs(llm), logprobs(LLM(str(plain))))


@pytest.mark.parametrize(("family", "experts"), LATER_CASES)
def test_later_family_writer_is_llama_cpps_converter(tiny_model, tmp_path, family, experts):
    """testing/tiny_gguf_archs writes what convert_hf_to_gguf.py writes for the same checkpoint
    (every tensor's name, type, shape and bytes; every key under the architecture), so the
    test above stands for llama.cpp's files; and hetserve on the converter's own file is no
    further from the file's exact model than llama.cpp is."""
    from hetserve.bench.decode_llamacpp import convert, find_converter
    from hetserve.testing.tiny_gguf_archs import write_family_gguf
    from hetserve.testing.tiny_quant import write_quantized

    src = find_converter(envs.llama_cpp_src())
    if src is None:
        pytest.skip(f"llama.cpp's converter not found (set {envs.LLAMA_CPP_SRC})")
    import gguf

    ckpt = _on_file_grid(tiny_model(family, overrides=LATER[family]), tmp_path / "ref", False)
    source = ckpt
    if experts == "mxfp4":  # the converter takes MXFP4 experts from an MXFP4 checkpoint
        source = write_quantized(ckpt, tmp_path / "mx", "mxfp4", tmp_path / "mxref")
    (tmp_path / "alone").mkdir()
    theirs = convert(source, tmp_path / "alone" / "m.gguf", src, "q8_0")
    ours = write_family_gguf(ckpt, tmp_path / "ours.gguf", "q8_0", experts)
    a, b = gguf.GGUFReader(str(ours)), gguf.GGUFReader(str(theirs))
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert set(ta) == set(tb)
    for name, t in tb.items():
        assert (ta[name].tensor_type, list(ta[name].shape)) == (t.tensor_type, list(t.shape)), name
        assert np.array_equal(np.asarray(ta[name].data).view(np.uint8),
                              np.asarray(t.data).view(np.uint8)), name  # fmt: skip
    arch = b.fields["general.architecture"].contents()
    for key, f in b.fields.items():
        if key.startswith(arch + ".") or key == "tokenizer.chat_template":
            assert key in a.fields and a.fields[key].contents() == f.contents(), key
    exact = _transformers_logprobs(tmp_path / "mxref" if experts == "mxfp4" else ckpt)
    err = (logprobs(LLM(str(theirs), placement="device")) - exact).abs()
    assert float(err.max()) <= 1e-3
    try:
        import llama_cpp
    except ImportError:
        return
    try:
        peer = llama_cpp.Llama(str(theirs), logits_all=True, n_ctx=128, verbose=False, n_threads=2)
    except ValueError:  # llama-cpp-python 0.3.36 does not load this tiny deepseek32 file
        return
    peer.eval(IDS)
    lp = torch.log_softmax(torch.tensor(np.array(peer.scores[: len(IDS)])), -1)
    theirs_err = torch.tensor([float(lp[i, IDS[i + 1]]) for i in range(len(IDS) - 1)]) - exact
    assert float(err.max()) <= float(theirs_err.abs().max())


def test_gpt_oss_greedy_tokens_are_llama_cpps(tmp_path):
    """A gpt-oss file in its published GGUF's types (MXFP4 experts, q8_0 attention, embeddings
    and output; random blocks): hetserve's greedy tokens are llama.cpp's on the same file."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from hetserve import SamplingParams
    from hetserve.testing.random_gguf import GPT_OSS_20B, write_random_gpt_oss

    small = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 256,
             "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1024}  # fmt: skip
    path = tmp_path / "m.gguf"
    write_random_gpt_oss(path, {**GPT_OSS_20B, **small})
    peer = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False)
    gen = peer.generate([65, 66, 67], temp=0.0, top_k=1)
    theirs = [next(gen) for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(path), max_model_len=256)
    assert {e.backend_name for _, e in llm.model.routed_experts()} <= {"cpu-mxfp4", "placed"}
    ours = llm.generate(prompt_token_ids=[65, 66, 67], sampling_params=params)[0].token_ids
    assert list(ours) == theirs


def test_mxfp4_relaid_natively_as_by_torch(monkeypatch):
    """GGUF MXFP4 blocks re-laid for cpu-mxfp4 by native/layouts.c equal the torch path's
    bytes, and both stand for gguf's own dequantization of the blocks."""
    from hetserve.quant.gguf import mxfp4_rows

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(3, 64, 4 * 17), dtype=np.uint8)
    raw[..., ::17] = rng.integers(110, 130, size=raw[..., ::17].shape)  # finite scales
    native = mxfp4_rows(raw)
    monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", "0")
    plain = mxfp4_rows(raw)
    assert torch.equal(native.blocks, plain.blocks) and torch.equal(native.scales, plain.scales)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(native.dequantize().numpy(), want.reshape(3, 64, 128))


def test_yarn_from_any_familys_file(tiny_model, tmp_path):
    """A Qwen3-MoE file with YaRN keys (rope.scaling.*, as the converter writes a long-context
    model's) runs YaRN: against transformers with the same rope_parameters, on the file's
    exact numbers (q8_0 experts on their kernel). Without the scaling the logprobs move."""
    from hetserve.testing.tiny_gguf import write_gguf

    src = tiny_model("qwen3-moe")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = write_gguf(src, tmp_path / "a" / "m.gguf", tmp_path / "ref", "q8_0", "f32")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0}  # fmt: skip

    def extra(writer, reader):
        writer.add_string("qwen3moe.rope.scaling.type", "yarn")
        writer.add_float32("qwen3moe.rope.scaling.factor", yarn["factor"])
        writer.add_uint32("qwen3moe.rope.scaling.original_context_length", 16)

    path = _rewritten(plain, tmp_path / "b" / "m.gguf", extra=extra)
    cfg = json.loads((tmp_path / "ref" / "config.json").read_text())
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta")
    cfg["rope_parameters"] = {**yarn, "rope_theta": theta}
    (tmp_path / "ref" / "config.json").write_text(json.dumps(cfg))
    ours = logprobs(LLM(str(path), placement="device"))
    assert float((ours - _transformers_logprobs(tmp_path / "ref")).abs().max()) <= 1e-3
    assert float((ours - logprobs(LLM(str(plain), placement="device"))).abs().max()) > 1e-3
