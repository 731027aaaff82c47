"""Split GGUF models load from their first part; a file cut short or of an unknown tensor type
is refused in one line naming the tensor (the CLI: that line, exit 2)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from hetserve import LLM  # noqa: E402
from hetserve.errors import ModelLoadError, ModelNotFoundError  # noqa: E402
from hetserve.testing.tiny_gguf import write_gguf  # noqa: E402

from .test_gguf import SHAPE, logprobs  # noqa: E402


@pytest.fixture(scope="module")
def files(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-parts")
    (root / "whole").mkdir()
    src = tiny_model("qwen3-moe", overrides=SHAPE)
    whole = write_gguf(src, root / "whole" / "m.gguf", root / "ref", "q4_K", "q8_0")
    (root / "split").mkdir()
    first = write_gguf(src, root / "split" / "m.gguf", root / "ref2", "q4_K", "q8_0",
                       split_max_tensors=8)  # fmt: skip
    return whole, first


def test_split_model_loads_from_its_first_part(files):
    whole, first = files
    parts = sorted(first.parent.glob("m-*-of-*.gguf"))
    assert first.name.startswith("m-00001-of-") and len(parts) > 2
    torch.testing.assert_close(logprobs(LLM(str(first))), logprobs(LLM(str(whole))))
    with pytest.raises(ModelLoadError, match="pass its first part"):
        LLM(str(parts[1]))
    moved = parts[-1].with_suffix(".bak")
    os.rename(parts[-1], moved)
    try:
        with pytest.raises(ModelNotFoundError, match=f"part .*{parts[-1].name} is missing"):
            LLM(str(first))
    finally:
        os.rename(moved, parts[-1])


def test_renamed_first_part_says_the_parts_are_found_by_name(files, tmp_path):
    # Found in a trial: a first part renamed model.gguf was told to "pass its first part".
    renamed = tmp_path / "model.gguf"
    shutil.copy2(files[1], renamed)
    with pytest.raises(ModelLoadError, match="is the first part .* renamed: .* found by name"):
        LLM(str(renamed))


def test_truncated_file_names_the_tensor(files, tmp_path):
    whole, _ = files
    cut = tmp_path / "cut.gguf"
    shutil.copy2(whole, cut)
    with open(cut, "r+b") as f:
        f.truncate(os.path.getsize(whole) - 1000)
    last = gguf.GGUFReader(str(whole)).tensors[-1].name
    with pytest.raises(ModelLoadError, match=f"tensor '{last}' .*the file is truncated"):
        LLM(str(cut))
    proc = subprocess.run(
        [sys.executable, "-m", "hetserve.cli", "generate", "--model", str(cut), "hi"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and last in lines[0] and "truncated" in lines[0]


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[:100],  # cut inside the metadata
        lambda b: b[:8] + (2**48).to_bytes(8, "little") + b[16:],  # a tensor count past the end
        lambda b: b[:16] + (2**48).to_bytes(8, "little") + b[24:],  # a key count past the end
    ],
    ids=["cut-in-header", "tensor-count", "key-count"],
)
def test_damaged_header_is_one_line_saying_so(files, tmp_path, damage):
    # Found in a trial: these said "index 0 is out of bounds for axis 0 with size 0".
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(files[0].read_bytes()))
    with pytest.raises(ModelLoadError, match="header .* runs past the end .* truncated or corrupt"):
        LLM(str(bad))


def test_folder_holding_a_gguf_names_the_file_to_pass(files, tmp_path):
    # Found in a trial: --model DIR asked for an HF directory (config.json + *.safetensors).
    whole, first = files
    with pytest.raises(ModelNotFoundError, match=f"pass the file: --model {whole}"):
        LLM(str(whole.parent))
    with pytest.raises(ModelNotFoundError, match=f"pass the file: --model {first}"):
        LLM(str(first.parent))


def _mapped_rss(path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
                inside = len(head) > 5 and head[5] == str(path)
            elif inside and head[0] == "Rss:":
                rss += int(head[1]) * 1024
    return rss


@pytest.mark.parametrize("split", [False, True])
def test_reading_lets_go_of_the_files_pages(files, split):
    """Every tensor read leaves the file's pages it was copied from (in every part of a split
    model): they would otherwise stay resident beside the copies, and a load would peak at
    twice the file (the 1.7 B MoE's q8_0 GGUF: 4003 -> 2344 MiB over a 1723 MiB file)."""
    from hetserve.model.gguf_file import GgufCheckpoint

    first = files[1] if split else files[0]
    ckpt = GgufCheckpoint(first)
    paths = [Path(r.data.filename).resolve() for r in ckpt.parts]
    assert len(paths) == (len(list(first.parent.glob("m-*-of-*.gguf"))) if split else 1)
    values = list(ckpt.tensors(lambda _: True))  # everything, kept alive: copies, not views
    assert values
    # What stays are the headers (each tensor's shape and type are read from there) and pages
    # a read fault mapped around it (Linux's fault-around, 64 KiB windows): a small fraction
    # of the files, where before every page stayed.
    total = sum(os.path.getsize(p) for p in paths)
    assert total > 1 << 20
    assert sum(_mapped_rss(p) for p in paths) <= total // 4
    for reader, path in zip(ckpt.parts, paths, strict=True):  # mapped in again: the same bytes
        assert bytes(reader.data[:64]) == path.read_bytes()[:64]


def test_metadata_read_in_one_pass_equals_gguf_reader(files, tiny_model, tmp_path):
    """The one-pass reading of metadata arrays (tokens, token types, merges, a bool array)
    gives every field gguf's own reader gives, whole and by index; an array cut short by a
    damaged length is a one-line error."""
    from hetserve.model.gguf_parts import open_reader
    from hetserve.testing.tiny_gguf_archs import write_family_gguf

    hybrid = write_family_gguf(tiny_model("qwen3-next"), tmp_path / "n.gguf", "q8_0")
    for path in (files[0], hybrid):
        ours, theirs = open_reader(gguf, path), gguf.GGUFReader(str(path))
        assert list(ours.fields) == list(theirs.fields)
        for key, f in theirs.fields.items():
            g = ours.fields[key]
            assert (list(g.types), g.contents()) == (list(f.types), f.contents()), key
            if f.types[0] == gguf.GGUFValueType.ARRAY:
                assert g.contents(0) == f.contents(0), key
        assert [(t.name, t.data_offset) for t in ours.tensors] == [
            (t.name, t.data_offset) for t in theirs.tensors
        ]
    raw = bytearray(hybrid.read_bytes())
    at = raw.find(b"tokenizer.ggml.merges") + len("tokenizer.ggml.merges") + 16
    raw[at : at + 8] = (1 << 40).to_bytes(8, "little")  # the first merge's length: 1 TB
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        open_reader(gguf, bad)
