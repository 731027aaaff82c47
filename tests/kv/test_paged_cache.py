"""The paged KV tensors on the CPU: zero, writable, and resident only as blocks are written (a
fresh anonymous mapping, kv/paged.py's `zeroed`), so a large cache costs nothing at start-up."""

from __future__ import annotations

import sys

import pytest
import torch

from hetserve.kv.paged import PagedKVCache, zeroed


def _rss_anon() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
def test_a_large_cpu_cache_is_resident_only_where_written():
    before = _rss_anon()
    cache = PagedKVCache([[(4, 64), (4, 64)]] * 4, 4096, 16, torch.float16, "cpu")  # 256 MiB
    made = _rss_anon()
    assert made - before < 16 << 20, (made - before) >> 20
    k = cache.layers[2][0]
    assert k.shape == (4096 * 16, 4, 64) and k.dtype == torch.float16
    assert not k[::997].any()  # zero where nothing was written (reads touch no new memory)
    rows = torch.randn(16, 4, 64).half()
    k[16 * 100 : 16 * 101] = rows  # one block
    assert torch.equal(k[16 * 100 : 16 * 101], rows)
    assert not k[16 * 101 : 16 * 102].any() and not cache.layers[2][1].any()
    assert _rss_anon() - before < 24 << 20


def test_int8_scales_and_small_tensors_are_zero_too():
    cache = PagedKVCache([[(2, 32)]], 8, 16, torch.int8, "cpu")  # 8 KiB: torch.zeros
    assert not cache.layers[0][0].any() and not cache.scales[0][0].any()
    assert cache.scales[0][0].shape == (128, 2) and cache.scales[0][0].dtype == torch.float32
    big = zeroed((1 << 20, 3), torch.float32, "cpu")  # 12 MiB: mapped
    assert big.is_contiguous() and not big.any()
    big[5] = 1.5
    assert big.sum().item() == 4.5
