"""quant/lane_order.py: the row kernels' order of a GGUF super-block moves codes and nothing else.

With every scale (and minimum) of a block equal, a block's numbers no longer depend on which
scale group a column is in, so a regrouped K-quant block read as if it were the file's holds at
position p exactly the original's column PERM[p] (the IQ4 types' nibbles also move within
their bytes: read in the kernels' chunks); the kernels' own tests (test_gguf_experts.py,
test_native_isa.py) check the arithmetic on top."""

from __future__ import annotations

import pytest
import torch

from hetserve import native
from hetserve.quant.gguf import Q2KRows, Q3KRows, Q5KRows, Q6KRows
from hetserve.quant.gguf_iq import IQ4_LEVELS, IQ4NLRows, IQ4XSRows
from hetserve.quant.lane_order import KERNEL_ORDER, PERM16, PERM32, TORCH_ORDER

ONE = (0x00, 0x3C)  # fp16 1.0, little-endian
# (class, block bytes, [(offset, length)] of scale bytes set to 0x55, fp16 offsets, permutation):
# 0x55 gives every 6-bit (q4_K-style, q3_K, IQ4_XS) or 4-bit (q2_K) scale and minimum the same
# value (21 or 5)
FORMATS = {
    "q6_K": (Q6KRows, 210, [(192, 16)], [208], PERM16),
    "q5_K": (Q5KRows, 176, [(4, 12)], [0, 2], PERM32),
    "q3_K": (Q3KRows, 110, [(96, 12)], [108], PERM16),
    "q2_K": (Q2KRows, 84, [(0, 16)], [80, 82], PERM16),
}


def _even_blocks(shape, nbytes, scales, halves, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*shape, nbytes), dtype=torch.uint8, generator=g)
    for o, n in scales:
        raw[..., o : o + n] = 0x55
    for o in halves:
        raw[..., o], raw[..., o + 1] = ONE
    return raw


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_regrouping_moves_codes_only(name):
    cls, nbytes, scales, halves, perm = FORMATS[name]
    raw = _even_blocks((3, 2), nbytes, scales, halves, seed=len(name))
    ours = KERNEL_ORDER[cls](raw)
    assert ours.shape == raw.shape and ours.dtype == torch.uint8
    before = cls(raw).dequantize().reshape(3, 2, 256)
    after = cls(ours).dequantize().reshape(3, 2, 256)
    assert torch.equal(after, before[..., perm])
    assert before.abs().max() > 0
    # regrouping again is another permutation, not the identity: the order is not the file's
    assert not torch.equal(ours, raw)


def _iq4_levels(nibbles):
    """[.., 128] bytes in the IQ4 kernels' order (chunk c's byte l: position 64 c + l in its
    low nibble, 64 c + 32 + l in its high one) -> the levels [.., 256] by position."""
    c = nibbles.to(torch.long).reshape(*nibbles.shape[:-1], 4, 1, 32)
    codes = torch.cat((c & 15, c >> 4), dim=-2).reshape(*nibbles.shape[:-1], 256)
    return IQ4_LEVELS[codes]


def test_iq4_xs_regroups_its_nibbles():
    raw = _even_blocks((3, 2), 136, [(2, 6)], [0], seed=5)  # every ls - 32 = -11
    ours = KERNEL_ORDER[IQ4XSRows](raw)
    assert ours.shape == raw.shape and torch.equal(ours[..., :8], raw[..., :8])
    before = IQ4XSRows(raw).dequantize().reshape(3, 2, 256)
    assert torch.equal(_iq4_levels(ours[..., 8:]) * -11, before[..., PERM32])


def test_iq4_nl_regroups_eight_blocks_with_their_d_first():
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (2, 16, 18), dtype=torch.uint8, generator=g)  # 512 columns
    raw[..., 0], raw[..., 1] = ONE
    ours = KERNEL_ORDER[IQ4NLRows](raw)
    assert ours.shape == raw.shape
    before = IQ4NLRows(raw).dequantize().reshape(2, 2, 256)
    groups = ours.reshape(2, 2, 144)
    assert torch.equal(groups[..., :16], raw.reshape(2, 2, 8, 18)[..., :2].reshape(2, 2, 16))
    assert torch.equal(_iq4_levels(groups[..., 16:]), before[..., PERM32])


def test_permutations():
    for perm in (PERM32, PERM16):
        assert torch.equal(perm.sort().values, torch.arange(256))
    # lane i (4 bytes) of each 32 positions is one scale group: 32 columns, or 16 per half
    lanes = torch.arange(256) // 4 % 8
    assert torch.equal(PERM32 // 32, lanes)
    assert torch.equal(PERM16 // 16, lanes + 8 * (torch.arange(256) // 128))


@pytest.mark.skipif(bool(native.native_unavailable_reason()), reason="native kernels unavailable")
@pytest.mark.parametrize("cls", sorted(TORCH_ORDER, key=lambda c: c.__name__))
def test_native_regrouping_equals_torch(cls, monkeypatch):
    """native/layouts.c's hetserve_kq_lanes (what loads use) gives torch's bytes, on random
    blocks (every bit pattern of codes, scales and d), over several work items' worth."""
    monkeypatch.setenv("HETSERVE_NATIVE_KERNELS", "1")
    g = torch.Generator().manual_seed(7)
    block = {Q6KRows: 210, Q5KRows: 176, Q3KRows: 110, Q2KRows: 84, IQ4XSRows: 136}
    shape = (3, 8 * 2200, 18) if cls is IQ4NLRows else (3, 11000, block[cls])
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    assert torch.equal(KERNEL_ORDER[cls](raw), TORCH_ORDER[cls](raw))
