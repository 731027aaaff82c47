"""KV cache store: one API (`api.KVStore`) over local DRAM/SSD, the pool service, Mooncake, Redis.

from hetserve.store import open_store
store = open_store("local://?dram=1G&ssd_dir=/tmp/kv&ssd=4G")
"""

from hetserve.store.api import (
    BufferTooSmallError,
    InvalidKeyError,
    KVStore,
    ReplicateConfig,
    SizeMismatchError,
    StoreCapacityError,
    StoreDependencyError,
    StoreError,
    StoreUnavailableError,
    TierInfo,
    ValueTooLargeError,
)
from hetserve.store.registry import open_store, parse_size, parse_spec

__all__ = [
    "BufferTooSmallError",
    "InvalidKeyError",
    "KVStore",
    "ReplicateConfig",
    "SizeMismatchError",
    "StoreCapacityError",
    "StoreDependencyError",
    "StoreError",
    "StoreUnavailableError",
    "TierInfo",
    "ValueTooLargeError",
    "open_store",
    "parse_size",
    "parse_spec",
]
