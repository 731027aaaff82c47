"""hugepage_empty: the weight buffers of the native kernels ask for 2 MiB pages on fresh memory."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from hetserve.native import hugepage_empty

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_fields(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address `addr`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            if inside:
                break
            inside = lo <= addr < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_small_requests_are_plain_tensors():
    t = hugepage_empty((3, 5), torch.float32)
    assert t.shape == (3, 5) and t.dtype == torch.float32


@pytest.mark.skipif(platform.system() != "Linux", reason="transparent huge pages are Linux's")
def test_large_buffer_is_aligned_private_and_thp_eligible():
    t = hugepage_empty((4, 1024, 1024), torch.int32)  # 16 MiB
    assert t.shape == (4, 1024, 1024) and t.dtype == torch.int32 and t.is_contiguous()
    assert t.data_ptr() % (2 << 20) == 0
    t.fill_(7)
    assert int(t.sum()) == 7 * t.numel()
    fields = _mapping_fields(t.data_ptr())
    # A shared anonymous mapping would be shmem, where the anon THP setting does not apply.
    assert fields, "the buffer's mapping is not in /proc/self/smaps"
    if THP.exists() and "[never]" not in THP.read_text() and "THPeligible" in fields:
        assert fields["THPeligible"] == "1"
