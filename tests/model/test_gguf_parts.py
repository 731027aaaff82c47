"""Split GGUF models load from their first part; a file cut short or of an unknown tensor type
is refused in one line naming the tensor (the CLI: that line, exit 2)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

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
