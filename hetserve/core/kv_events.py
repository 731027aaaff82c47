"""KV events: changes to what an instance's KV cache holds, named and encoded as vLLM does.

Who uses them: the engine's recorder (`kv/events.py`) makes them, the publisher
(`disagg/kv_publisher.py`) numbers, encodes and sends them, subscribers (`disagg/kv_subscriber.py`,
or an outside router: Dynamo's, llm-d's, Mooncake's indexer) decode them, and the Conductor's
index (`disagg/index.py`) applies them.

The wire format is vLLM's (`vllm/distributed/kv_events.py` since vllm-project/vllm#42892): a
batch is a msgpack array `[ts, events, data_parallel_rank]`; each event is a msgpack map tagged
by its `"type"` ("BlockStored", "BlockRemoved", "AllBlocksCleared") whose keys are the field
names below, in this order, fields at their default left out. Block hashes are bytes: a
`BlockHash`'s sha256 digest (vLLM allows bytes or int hashes). The blocks of one `BlockStored`
are consecutive: each one's parent is the one before it, the first one's `parent_block_hash`.
Fields vLLM added later with defaults (`extra_keys`, `group_idx`, ...) are not declared: we
never send them, and a decoder here ignores them.

`medium` says where the blocks are (vLLM's GPU and CPU, and the DISK and POOL of a KV store);
None, as older vLLM sent, means the GPU.
"""

from __future__ import annotations

import msgspec

MEDIUM_GPU = "GPU"  # the engine's own paged KV cache (on a CPU-only engine too)
MEDIUM_CPU = "CPU"  # host DRAM: a local store's DRAM tier
MEDIUM_DISK = "DISK"  # a local store's SSD tier
MEDIUM_POOL = "POOL"  # a store shared by the instances (pool, Mooncake, Redis)
MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_POOL)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change; encoded as a map tagged `"type": <class name>`."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]  # block_size per block; empty where the medium does not know them
    block_size: int
    lora_id: int | None  # vLLM's deprecated integer id: always None here
    medium: str | None
    lora_name: str | None  # the LoRA adapter's content id (part of the blocks' identity)


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """The instance holds nothing any more (in GPU, CPU and DISK; a shared POOL outlives it)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # wall-clock seconds when the batch was made
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises msgspec.DecodeError (a ValueError) on bytes that are not such a batch."""
    return _DECODER.decode(payload)
