"""A DRAM reservation larger than the host can give is refused before it is taken: the local
store's and a pool node's are touched in full at start, and the README's own `--dram 64G` on a
23 GiB machine ended in the kernel's OOM killer (which took unrelated processes along)."""

import pytest

from hetserve.errors import InvalidInputError
from hetserve.store.host_memory import MAX_SHARE, available_bytes, check_reservation

GIB = 1 << 30


def test_a_reservation_past_what_is_available_names_the_option_to_lower():
    check_reservation(int(MAX_SHARE * 10 * GIB), "x", "--dram", available=10 * GIB)
    with pytest.raises(InvalidInputError, match=r"lower --dram to at most ~9.0 GiB"):
        check_reservation(10 * GIB, "a pool node's DRAM", "--dram", available=10 * GIB)


def test_this_host_reports_its_memory_and_a_huge_store_is_refused(tmp_path):
    avail = available_bytes()
    assert avail is None or avail > 0
    bad = tmp_path / "meminfo"
    bad.write_text("MemTotal: 1 kB\n")
    assert available_bytes(str(bad)) is None  # nothing to go by: nothing checked
    if avail is None:
        pytest.skip("no /proc/meminfo here")
    from hetserve.store.registry import open_store

    with pytest.raises(InvalidInputError, match="local KV store's DRAM"):
        open_store(f"local://?dram={4 * avail // GIB + 4}G")
    from hetserve.store.pool.node import PoolNode

    with pytest.raises(InvalidInputError, match="lower --dram"):
        PoolNode(("127.0.0.1", 1), 4 * avail)

