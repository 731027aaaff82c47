"""One simulated request as it moves through the cluster: what the trace says, what the
Conductor decided, and when each stage happened (simulated seconds)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Job:
    idx: int
    arrival: float
    input_length: int
    output_length: int
    priority: int
    blocks: tuple[int, ...]  # the prompt's full blocks
    usable: int  # blocks a hit may cover: the last prompt token is always computed
    # The decision.
    prefill: int = -1
    decode: int = -1
    cached_tokens: int = 0
    local_blocks: int = 0  # loaded from the prefill instance's own DRAM
    pool_blocks: int = 0  # pulled over the network from the global pool
    predicted_ttft: float | None = None
    rejected: str | None = None  # "admission" (the Conductor) or "decode" (after prefill)
    reason: str | None = None
    # What happened.
    load_s: float = 0.0
    compute_s: float = 0.0
    delivery_s: float = 0.0  # the client's wait beyond the compute (the profile's delivery fit)
    prefill_start: float | None = None
    prefill_end: float | None = None
    kv_arrival: float | None = None
    decode_join: float | None = None
    finish: float | None = None
    tbt: float | None = None  # mean of the longest 10% of token intervals (Mooncake's TBT)
    join_step: int = 0
    join_segment: int = 0

    @property
    def new_tokens(self) -> int:
        return self.input_length - self.cached_tokens

    @property
    def ttft(self) -> float | None:
        if self.prefill_end is None:
            return None
        return self.prefill_end - self.arrival + self.delivery_s

    @property
    def decode_tokens(self) -> int:
        """Context a decode instance reserves for it: the prompt and every output token."""
        return self.input_length + self.output_length
