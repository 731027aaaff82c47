"""The local backend's tiers: DRAM LRU spilling to SSD files, promotion on SSD hits."""

from __future__ import annotations

import pytest

from hetserve.errors import InvalidInputError
from hetserve.store import (
    ReplicateConfig,
    StoreCapacityError,
    ValueTooLargeError,
    open_store,
    parse_size,
)

from .helpers import MiB, payload


def test_parse_size_and_unknown_scheme():
    assert parse_size("4K") == 4096 and parse_size("1.5M") == 3 * MiB // 2
    assert parse_size("2GiB") == 2 << 30 and parse_size("100") == 100
    with pytest.raises(InvalidInputError):
        parse_size("lots")
    with pytest.raises(InvalidInputError, match="known schemes"):
        open_store("ftp://x")


def test_spill_to_ssd_and_promote(tmp_path):
    store = open_store(f"local://?dram=3M&ssd_dir={tmp_path}&ssd=4M")
    keys = [f"k{i}" for i in range(5)]
    for k in keys:
        store.put(k, payload(MiB, k))
        store.check_integrity()
    assert store.dram_used <= 3 * MiB and store.ssd.used == 2 * MiB
    assert "k0" in store.ssd and len(list(tmp_path.glob("*.hskv"))) == 2
    assert store.get("k0") == payload(MiB, "k0")  # SSD hit ...
    assert "k0" in store._dram and "k0" not in store.ssd  # ... promoted to DRAM
    store.check_integrity()
    for k in keys:
        got = store.get(k)
        assert got is None or got == payload(MiB, k)
    store.close()


def test_ssd_overflow_drops_lru_and_damaged_file_is_a_miss(tmp_path):
    store = open_store(f"local://?dram=1M&ssd_dir={tmp_path}&ssd=2M")
    for i in range(6):
        store.put(f"k{i}", payload(MiB, f"k{i}"))
    assert store.batch_exists([f"k{i}" for i in range(6)]) == 0  # k0 dropped entirely
    assert store.exists("k5") and store.exists("k4") and store.exists("k3")
    victim = next(tmp_path.glob("*.hskv"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(data)
    assert [store.get(f"k{i}") is None for i in (3, 4)].count(True) == 1
    store.check_integrity()


def test_limits(tmp_path):
    store = open_store("local://?dram=1M&max_value=2M")
    with pytest.raises(ValueTooLargeError):
        store.put("big", bytes(3 * MiB))
    with pytest.raises(StoreCapacityError):
        store.put("big", bytes(MiB + 1))
    store.put("empty", b"")
    assert store.get("empty") == b""


def test_spill_then_locate_says_ssd_and_parts_read_from_ssd(tmp_path):
    store = open_store(f"local://?dram=2M&ssd_dir={tmp_path}&ssd=4M")
    keys = [f"k{i}" for i in range(4)]
    for k in keys:  # 1 MiB each in two parts: k0 and k1 spill to SSD
        store.put_parts(k, [payload(MiB // 2, k), payload(MiB // 2, k + "b")])
    assert store.batch_locate(keys) == ["ssd", "ssd", "dram", "dram"]
    assert store.batch_locate(["k2", "nope", "k3"]) == ["dram", None, None]
    tiers = {t.name: t for t in store.tiers()}
    assert tiers["ssd"].used == 2 * MiB and tiers["ssd"].capacity == 4 * MiB
    assert tiers["dram"].used == 2 * MiB and not tiers["dram"].shared
    dest = [bytearray(MiB // 4) for _ in range(4)]
    store.make_cold("k0")  # the read comes from the disk, not the page cache
    assert store.get_into_parts("k0", dest) == MiB  # an SSD hit, scattered by preadv ...
    assert b"".join(dest) == payload(MiB // 2, "k0") + payload(MiB // 2, "k0b")
    assert store.batch_locate(["k0"]) == ["dram"]  # ... and promoted
    store.check_integrity()
    store.close()


def test_preferred_tier_puts_straight_to_ssd(tmp_path):
    store = open_store(f"local://?dram=4M&ssd_dir={tmp_path}&ssd=4M")
    store.put("cold", payload(1000, "cold"), ReplicateConfig(preferred_segment="ssd"))
    store.put("hot", payload(1000, "hot"), ReplicateConfig(preferred_segment="dram"))
    assert store.batch_locate(["cold", "hot", "none", "hot"]) == ["ssd", "dram", None, None]
    assert store.get("cold") == payload(1000, "cold")
    with pytest.raises(InvalidInputError, match="no tier 'nvme'"):
        store.put("x", b"x", ReplicateConfig(preferred_segment="nvme"))
    no_ssd = open_store("local://?dram=1M")
    with pytest.raises(InvalidInputError, match="no ssd_dir"):
        no_ssd.put("x", b"x", ReplicateConfig(preferred_segment="ssd"))
    assert [t.name for t in no_ssd.tiers()] == ["dram"]
    store.check_integrity()


def test_damaged_ssd_file_read_through_parts_is_a_miss(tmp_path):
    store = open_store(f"local://?dram=1M&ssd_dir={tmp_path}&ssd=4M")
    store.put_parts("a", [payload(MiB // 2, "a"), payload(MiB // 2, "a2")])
    store.put("b", payload(MiB, "b"))  # pushes a to SSD
    victim = next(tmp_path.glob("*.hskv"))
    data = bytearray(victim.read_bytes())
    data[-100] ^= 1
    victim.write_bytes(data)
    assert store.get_into_parts("a", [bytearray(MiB // 2), bytearray(MiB // 2)]) is None
    assert store.batch_locate(["a"]) == [None]  # dropped: never served again
    store.check_integrity()


def test_soft_pins_keep_objects_in_dram_until_their_ttl(tmp_path):
    import time

    from hetserve.store.api import ReplicateConfig

    with open_store("local://?dram=64K") as store:
        store.put("session", b"s" * 16384, ReplicateConfig(soft_pin=True, soft_pin_ttl_s=60))
        store.put("short", b"t" * 16384, ReplicateConfig(soft_pin=True, soft_pin_ttl_s=0.05))
        time.sleep(0.1)
        for i in range(8):  # four times the room: everything unpinned goes
            store.put(f"other{i}", bytes([i]) * 16384)
            store.check_integrity()
        assert store.exists("session") and not store.exists("short")
        assert store.get("session") == b"s" * 16384
