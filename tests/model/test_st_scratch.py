"""A safetensors checkpoint read with `reuse` (the loader's way): each ordinary tensor from 1 to
64 MiB lands in one reused buffer, the same numbers as a read into buffers of their own, the
next read overwriting the last; small tensors keep buffers of their own."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from hetserve.model.checkpoint import SafetensorsCheckpoint
from hetserve.model.st_file import Scratch
from hetserve.quant.checkpoint import checkpoint_format


def test_reused_reads_equal_fresh_ones_and_share_one_buffer(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(512, 1024, generator=gen),  # 2 MiB: reused
        "b.weight": torch.randn(768, 512, generator=gen),  # 1.5 MiB: reused
        "c.weight": torch.randn(64, generator=gen),  # small: its own
        "d.weight": torch.randn(1024, 1024, generator=gen),  # 4 MiB: the buffer grows
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt = SafetensorsCheckpoint.scan(tmp_path, checkpoint_format(None))  # plain tensors
    fresh = {n: v.clone() for n, v, _ in ckpt.tensors(lambda _: True)}
    seen, ptrs = {}, {}
    for name, value, nbytes in ckpt.tensors(lambda _: True, reuse=True):
        assert nbytes == value.nbytes
        seen[name] = value.clone()  # the caller's copy, before the next read
        ptrs[name] = value.data_ptr()
        for earlier, v in seen.items():
            assert torch.equal(v, tensors[earlier])
    assert set(seen) == set(tensors) and all(torch.equal(seen[n], fresh[n]) for n in tensors)
    assert ptrs["a.weight"] == ptrs["b.weight"]  # b fits a's buffer
    assert ptrs["c.weight"] != ptrs["a.weight"]


def test_scratch_takes_only_its_size_range():
    s = Scratch()
    assert s.take(Scratch.LOW - 1) is None and s.take(Scratch.HIGH + 1) is None
    a = s.take(Scratch.LOW)
    b = s.take(Scratch.LOW)
    assert a is not None and b is not None and a.data_ptr() == b.data_ptr()
    c = s.take(2 * Scratch.LOW)  # grows
    assert c is not None and c.numel() == 2 * Scratch.LOW
