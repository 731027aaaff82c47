"""The native linear-attention decode step (native/linear_attn.c) against the torch path it
replaces: conv windows, states and outputs, with grouped key heads and with per-channel decay."""

import pytest
import torch

from hetserve.layers import linear_attention as la
from hetserve.native import optional_kernel

pytestmark = pytest.mark.skipif(
    optional_kernel("hetserve_delta_decode") is None, reason="native kernels unavailable here"
)


@pytest.mark.parametrize(
    ("hk", "hv", "dk", "dv", "per_channel"),
    [(2, 4, 16, 24, False), (3, 3, 32, 32, True), (1, 2, 13, 7, False)],
)
def test_native_decode_equals_torch(hk, hv, dk, dv, per_channel):
    g = torch.Generator().manual_seed(0)
    heads = la.LinearHeads(hk, hv, dk, dv)
    c, kernel, slots_n, b = heads.conv_channels, 4, 9, 5
    windows = torch.randn(slots_n, c, kernel - 1, generator=g)
    states = torch.randn(slots_n, hv, dk, dv, generator=g) * 0.3
    slots = torch.tensor([7, 2, 5, 1, 8])
    x, w = torch.randn(b, c, generator=g), torch.randn(c, kernel, generator=g)
    decay_shape = (b, hv, dk) if per_channel else (b, hv)
    log_decay, beta = -torch.rand(decay_shape, generator=g), torch.rand(b, hv, generator=g)
    results = []
    for fn in (la._torch_decode, la._native_decode):
        win, st = windows.clone(), states.clone()
        out = fn(x, w, heads, log_decay, beta, win, st, slots)
        results.append((out, win, st))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    untouched = [i for i in range(slots_n) if i not in slots.tolist()]
    assert torch.equal(results[1][2][untouched], states[untouched])  # other slots as they were


def test_slot_out_of_range_raises():
    heads = la.LinearHeads(1, 1, 8, 8)
    windows, states = torch.zeros(2, heads.conv_channels, 3), torch.zeros(2, 1, 8, 8)
    x, w = torch.zeros(1, heads.conv_channels), torch.zeros(heads.conv_channels, 4)
    with pytest.raises(RuntimeError, match="code -2"):
        la._native_decode(x, w, heads, torch.zeros(1, 1), torch.zeros(1, 1), windows, states,
                          torch.tensor([2]))  # fmt: skip
