"""Engine configuration: frozen dataclasses, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # KV memory: an explicit block count wins; else `kv_cache_bytes`; else enough blocks for
    # max_num_seqs full-length sequences (capped at 2 GiB on CPU).
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    hash_seed: str = ""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" | "priority"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass(frozen=True)
class MoEConfig:
    # Per token, this many lowest-weighted routed experts of MoE layer L run while layer L+1
    # computes (never in the last MoE layer). 0 = exact.
    max_deferred_experts_per_token: int = 0
    # Placement rules: None = every module on the engine device with the reference backend;
    # "default" = routed experts on CPU with cpu-int8, the rest on the engine device; or a path
    # to a YAML rules file.
    placement: str | None = None
    gpu_experts: int = 0  # hottest experts per layer kept on the engine device
    routing_stats: str | None = None  # JSON from `hetserve calibrate` (needed by gpu_experts)
    cpu_threads: int | None = None  # threads of the dedicated CPU-experts pool
    record_routing_stats: bool = False  # count routing decisions (EngineCore.routing_stats())

    def __post_init__(self) -> None:
        if self.max_deferred_experts_per_token < 0:
            raise ValueError("max_deferred_experts_per_token must be >= 0")
        if self.gpu_experts < 0:
            raise ValueError("gpu_experts must be >= 0")
        if self.gpu_experts and self.placement is None:
            raise ValueError("gpu_experts needs a placement (e.g. placement='default')")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError("cpu_threads must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF directory; None = the embedded demo model
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    moe: MoEConfig = MoEConfig()
    seed: int = 0
