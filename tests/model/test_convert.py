"""`hetserve convert`: CPU-format experts on disk, served directly: the kernel layout (mapped,
read in place) and the portable one (dequantized, quantized again at load)."""

import subprocess
import sys

import pytest
import torch

from hetserve import LLM, SamplingParams
from hetserve.errors import ModelLoadError
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
    from hetserve.model.kernel_file import MappedKernelFile

    assert MappedKernelFile(out / "experts-int8.hsk").nbytes() < fp32_experts * 4 / 3
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


def test_a_conversion_that_fails_leaves_no_out_dir_and_runs_again(tiny_model, tmp_path):
    """A failed (or interrupted) conversion left a half-written OUT_DIR, which the next run
    refused as not empty; the group-size error now names one that fits."""
    from hetserve.errors import InvalidInputError

    model, out = tiny_model("qwen3-moe"), tmp_path / "c4"
    with pytest.raises(InvalidInputError, match="use --group-size 32"):
        convert(model, out, "int4", group_size=64)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    out.mkdir()  # an empty OUT_DIR is taken
    assert convert(model, out, "int4", group_size=32) == out
    assert (out / "config.json").is_file() and len(list(tmp_path.iterdir())) == 1


def _mapped_files(ptr: int) -> set[str]:
    """The files whose mappings in this process hold address `ptr`."""
    found = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi and len(fields) > 5:
                found.add(fields[5])
    return found


@pytest.mark.parametrize("arch,fmt,group", [("qwen3-moe", "int8", 0), ("deepseek-v3", "int4", 32)])
def test_kernel_layout_is_mapped_and_equals_the_portable_file(
    tiny_model, tmp_path, arch, fmt, group
):
    src = tiny_model(arch, overrides={"moe_intermediate_size": 64})
    kernel = convert(src, tmp_path / "kernel", fmt, group or 64)
    portable = convert(src, tmp_path / "portable", fmt, group or 64, layout="portable")
    assert not (kernel / f"experts-{fmt}.safetensors").exists()
    served = LLM(kernel, placement="device")
    for _, ex in served.model.routed_experts():
        assert ex.w13.numel() == 0 and ex.w2.numel() == 0  # never materialized
        backend = ex._phase_backends["decode"]
        for t in backend._tensors:  # the kernel reads the file's pages
            if t is not None:
                assert _mapped_files(t.data_ptr()) == {str(kernel / f"experts-{fmt}.hsk")}
    assert torch.equal(logprobs(served), logprobs(LLM(portable, placement="device")))


def _last_tensor(path, modules_only: bool = False) -> tuple[str, dict]:
    """The kernel file's tensor that ends last ("module.field"), with its header entry."""
    from hetserve.model.kernel_file import MappedKernelFile

    header = MappedKernelFile(path, verify=False).header
    parts = [("modules", header["modules"])]
    if not modules_only:
        parts.append(("linears", header.get("linears", {})))
    found = [(f"{name}.{t['name']}", t) for _, group in parts for name, m in group.items()
             for t in m["tensors"] if t is not None]  # fmt: skip
    return max(found, key=lambda f: f[1]["offset"])


def _corrupt(path, how: str) -> None:
    _, entry = _last_tensor(path, modules_only=True)
    raw = bytearray(path.read_bytes())
    if how == "flip":  # one byte inside the last experts module's last tensor
        raw[entry["offset"] + entry["nbytes"] // 2] ^= 0x5A
    elif how == "truncate":
        del raw[len(raw) - 1000 :]
    else:  # a layout version this hetserve does not read
        i = raw.index(b'"version": 1')
        raw[i : i + 12] = b'"version": 7'
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["flip", "truncate", "version"])
def test_damaged_kernel_file_is_one_line_naming_the_tensor(tiny_model, tmp_path, how):
    src = tiny_model("qwen3-moe", overrides={"moe_intermediate_size": 64})
    out = convert(src, tmp_path / "k", "int8")
    last = _last_tensor(out / "experts-int8.hsk")[0]
    _corrupt(out / "experts-int8.hsk", how)
    with pytest.raises(ModelLoadError) as err:
        LLM(out, placement="device")
    msg = str(err.value)
    assert "\n" not in msg and "re-run hetserve convert" in msg
    if how == "version":
        assert "version 7" in msg and "version 1" in msg
    elif how == "flip":
        experts = "model.layers.1.mlp.experts"
        assert f"'{experts}.s2'" in msg or f"'{experts}.w2'" in msg, msg
    else:  # the tensor lying past the end: the file's last (a dense linear's, written last)
        assert f"'{last}'" in msg, msg
    if how != "flip":
        return
    r = subprocess.run(
        [sys.executable, "-m", "hetserve.cli", "generate", "--model", str(out), "--device", "cpu",
         "--max-tokens", "1", "hi"], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and lines[-1].startswith("error:") and "Traceback" not in r.stderr


def test_kernel_layout_refuses_another_backends_format(tiny_model, tmp_path):
    from hetserve.errors import InvalidInputError
    from hetserve.model.kernel_file import MappedKernelFile
    from hetserve.moe.experts import ExpertWeights, create_backend

    src = tiny_model("qwen3-moe", overrides={"moe_intermediate_size": 64})
    out = convert(src, tmp_path / "k", "int4", 32)
    mapped = MappedKernelFile(out / "experts-int4.hsk")
    lay = mapped.module(mapped.names()[0])
    weights = ExpertWeights(None, None, layout=lay)
    assert create_backend("cpu-int4", weights, group_size=32).nbytes() == lay.nbytes
    for name, opts in (("cpu-int8", {}), ("cpu-int4", {"group_size": 64})):
        with pytest.raises(InvalidInputError, match="kernel format 2 with groups of 32"):
            create_backend(name, weights, **opts)
    with pytest.raises(InvalidInputError, match="--layout portable"):
        weights.expert(0)  # nothing else reads the kernels' bytes


def test_files_with_crc32_digests_still_load_and_are_checked(tiny_model, tmp_path, monkeypatch):
    """Kernel files written before the xxh3-64 digests carry CRC-32s: the reader checks those."""
    import types
    import zlib

    from hetserve.model import kernel_file
    from hetserve.quant.kernel_file import tensor_entry

    def old_entry(name, t, offset, digest):
        entry = tensor_entry(name, t, offset, digest)
        entry["crc32"] = entry.pop("xxh3")
        return entry

    monkeypatch.setattr(kernel_file, "xxhash", types.SimpleNamespace(xxh3_64_intdigest=zlib.crc32))
    monkeypatch.setattr(kernel_file, "tensor_entry", old_entry)
    src = tiny_model("qwen3-moe", overrides={"moe_intermediate_size": 64})
    out = convert(src, tmp_path / "k", "int8")
    monkeypatch.undo()
    assert b'"crc32"' in (out / "experts-int8.hsk").read_bytes()[:65536]
    LLM(out, placement="device")  # verified and served
    _corrupt(out / "experts-int8.hsk", "flip")
    with pytest.raises(ModelLoadError, match="crc32"):
        LLM(out, placement="device")


def test_a_verified_file_is_mapped_without_reading_it_again(tiny_model, tmp_path, monkeypatch):
    """The digests are checked on the first load of each version of the file (a stamp under
    HETSERVE_CACHE remembers it: a load that serves only the experts from it checks the dense
    linears before stamping); later loads map it without reading it; any write to the file (a
    new mtime and ctime) brings the check back, and `always` checks every load."""
    import types

    from hetserve.model import kernel_file

    monkeypatch.setenv("HETSERVE_CACHE", str(tmp_path / "cache"))
    calls = []

    def counting(part):
        calls.append(len(part))
        return real(part)

    real = kernel_file.xxhash.xxh3_64_intdigest
    monkeypatch.setattr(kernel_file, "xxhash", types.SimpleNamespace(xxh3_64_intdigest=counting))
    src = tiny_model("qwen3-moe", overrides={"moe_intermediate_size": 64})
    out = convert(src, tmp_path / "k", "int8")
    path = out / "experts-int8.hsk"
    written = len(calls)  # the writer's own digests
    first = logprobs(LLM(out, placement="device"))
    checked = len(calls) - written
    assert checked > 0 and list((tmp_path / "cache" / "verified").iterdir())
    assert torch.equal(logprobs(LLM(out, placement="device")), first)
    assert len(calls) == written + checked  # mapped, not read
    monkeypatch.setenv("HETSERVE_VERIFY_CONVERTED", "always")
    LLM(out, placement="all-int8", device="cpu")  # the experts and every dense linear it maps
    assert len(calls) == written + 2 * checked
    monkeypatch.delenv("HETSERVE_VERIFY_CONVERTED")
    _corrupt(path, "flip")  # rewritten: the stamp no longer matches
    with pytest.raises(ModelLoadError, match="corrupt"):
        LLM(out, placement="device")


@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen3-next", "kimi-linear"])
def test_dense_linears_are_mapped_and_equal_rounding_at_load(tiny_model, tmp_path, arch,
                                                             monkeypatch):  # fmt: skip
    """The kernel file holds the dense linears as all-int8 serves them (qwen3-next's and
    kimi-linear's kept-precise projections with their residual rows): served from the mapping,
    their float32 weights never read, bit-equal to rounding the source checkpoint at load, W8A8
    too; other placements read the float32 rest, which loads as the source's numbers (Qwen3-Next's
    zero-centred norms written as published), and the tokenizer of any kind comes along."""
    from hetserve.layers.int8_linear import Int8Linear
    from hetserve.model.st_file import SafetensorsFile

    src = tiny_model(arch, overrides={"moe_intermediate_size": 64})
    out = convert(src, tmp_path / "int8", "int8")
    hsk = str(out / "experts-int8.hsk")
    read: list[str] = []
    real_read = SafetensorsFile.read

    def recording(self, name, *args, **kwargs):
        read.append(name)
        return real_read(self, name, *args, **kwargs)

    monkeypatch.setattr(SafetensorsFile, "read", recording)
    served = LLM(out, placement="all-int8", device="cpu")
    linears = [m for m in served.model.modules() if isinstance(m, Int8Linear)]
    assert linears and all(_mapped_files(m._q.data_ptr()) == {hsk} for m in linears)
    assert not any(n.endswith("proj.weight") or n == "lm_head.weight" for n in read), read
    if arch == "qwen3-next":
        assert any(m._rows == 2 * m.out_features for m in linears)  # residual rows stored
    assert torch.equal(logprobs(served), logprobs(LLM(src, placement="all-int8", device="cpu")))
    a8 = LLM(out, placement="all-int8", device="cpu", activation_bits=8)
    ref = LLM(src, placement="all-int8", device="cpu", activation_bits=8)
    assert torch.equal(logprobs(a8), logprobs(ref))
    assert torch.equal(logprobs(LLM(out, placement="device")),
                       logprobs(LLM(src, placement="default")))  # fmt: skip


def _converted_int8(tiny_model, tmp_path):
    """A tiny qwen3-moe converted to int8 (kernel layout): its directory and kernel file."""
    src = tiny_model("qwen3-moe", overrides={"moe_intermediate_size": 64})
    out = convert(src, tmp_path / "int8", "int8")
    return out, out / "experts-int8.hsk"


def test_a_corrupt_dense_linear_is_named(tiny_model, tmp_path):
    from hetserve.model.kernel_file import MappedKernelFile

    out, path = _converted_int8(tiny_model, tmp_path)
    entry = MappedKernelFile(path).header["linears"]["lm_head"]["tensors"][0]
    raw = bytearray(path.read_bytes())
    raw[entry["offset"] + 7] ^= 0x5A
    path.write_bytes(bytes(raw))
    with pytest.raises(ModelLoadError, match="'lm_head.w' is corrupt"):
        LLM(out, placement="all-int8", device="cpu")


def test_a_linear_entry_missing_its_fields_is_a_corrupt_header(tiny_model, tmp_path):
    import json

    from hetserve.model.kernel_file import MappedKernelFile
    from hetserve.quant.kernel_file import PREFIX, encode_prefix

    out, path = _converted_int8(tiny_model, tmp_path)
    header = MappedKernelFile(path, verify=False).header
    del header["linears"]["lm_head"]["rows"]
    raw = bytearray(path.read_bytes())
    _, _, offset, length = PREFIX.unpack(bytes(raw[: PREFIX.size]))
    text = json.dumps(header).encode()
    assert len(text) <= length  # rewritten in place: a shorter header
    raw[offset : offset + length] = text + b" " * (length - len(text))
    raw[: PREFIX.size] = encode_prefix(offset, len(text))
    path.write_bytes(bytes(raw))
    with pytest.raises(ModelLoadError, match="header is corrupt"):
        LLM(out, placement="all-int8", device="cpu")


def test_a_bf16_model_rounds_its_linears_anew(tiny_model, tmp_path):
    """The stored linears were rounded from float32: a model served in bfloat16 rounds its own."""
    from hetserve.layers.int8_linear import Int8Linear

    out, path = _converted_int8(tiny_model, tmp_path)
    served = LLM(out, placement="all-int8", device="cpu", dtype="bfloat16")
    linears = [m for m in served.model.modules() if isinstance(m, Int8Linear)]
    assert linears and not any(_mapped_files(m._q.data_ptr()) == {str(path)} for m in linears)
