"""EngineStats: a snapshot of one engine's state and counters, as `EngineCore.stats()` gives it.

Read by `/metrics`, the benchmarks and tests; a plain value, safe to hand to another thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoadFit:
    """One tier's loads as predicted at planning and as they happened: the reads (the store's
    batched call) and what the requests waited for them (a load off the engine thread is seen
    at a step boundary). Sums over `loads` loads; only whole single-tier reads are counted."""

    loads: int = 0
    predicted_s: float = 0.0
    measured_s: float = 0.0
    predicted_wait_s: float = 0.0
    measured_wait_s: float = 0.0

    @property
    def ratio(self) -> float | None:
        """Measured over predicted read time (1.0: the model is right); None without loads."""
        return self.measured_s / self.predicted_s if self.predicted_s > 0 else None

    @property
    def wait_ratio(self) -> float | None:
        p = self.predicted_wait_s
        return self.measured_wait_s / p if p > 0 else None


@dataclass(frozen=True)
class TierStats:
    """The KV tiers behind the prefix cache: what was found, loaded, skipped and saved."""

    lookups: int = 0
    loads: int = 0
    loaded_blocks: dict[str, int] = field(default_factory=dict)  # tier -> blocks loaded
    load_bytes: int = 0
    load_seconds: float = 0.0
    skipped_blocks: int = 0  # found, but recomputing them was predicted faster
    missed_blocks: int = 0  # found, but gone or corrupt by the time they were read
    saved_blocks: int = 0
    save_bytes: int = 0
    save_failed_blocks: int = 0
    shed_saves: int = 0  # dropped from a full save queue rather than stalling a step
    pending_saves: int = 0
    load_fit: dict[str, LoadFit] = field(default_factory=dict)  # tier -> predicted vs measured


@dataclass(frozen=True)
class HandoffStats:
    """Prefill/decode hand-offs: sent (by path) on a prefill instance, received on a decode
    instance. GB/s of a path: sent_bytes / send_seconds."""

    sent: dict[str, int] = field(default_factory=dict)  # path -> hand-offs shipped
    send_failed: int = 0
    sent_bytes: dict[str, int] = field(default_factory=dict)
    send_seconds: dict[str, float] = field(default_factory=dict)
    received: int = 0
    receive_failed: int = 0  # timed out or mismatched: recomputed
    received_bytes: int = 0
    wait_seconds: float = 0.0  # from a request's first admission attempt to its landing


@dataclass(frozen=True)
class EngineLoad:
    """What a cluster router needs of an instance's load, as of its last step."""

    queued_prefill_tokens: int = 0  # prompt tokens not computed yet (waiting and running)
    queued_requests: int = 0  # waiting for admission (or for their KV)
    running_decodes: int = 0  # running requests past their prompt
    decode_context_tokens: int = 0  # tokens those hold
    free_blocks: int = 0
    total_blocks: int = 0


@dataclass(frozen=True)
class Histogram:
    """Observations counted per bucket: `counts[i]` fell at or below `bounds[i]` and above the
    bound before it; the last count is above every bound. Not cumulative."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float = 0.0  # the sum of the observations

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class StepKindStats:
    """The engine's steps of one kind (decode-only, mixed, prefill-only): their wall time, the
    prompt chunks they carried, and the step-time model's prediction beside what happened."""

    seconds: Histogram
    chunk_tokens: Histogram  # each prompt chunk's tokens (none in decode-only steps)
    predicted_s: float = 0.0  # over the steps that had a prediction (not decode-only ones)
    measured_s: float = 0.0  # the same steps, as they ran

    @property
    def fit_ratio(self) -> float | None:
        """Measured over predicted time (1.0: the model is right); None without predictions."""
        return self.measured_s / self.predicted_s if self.predicted_s > 0 else None


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_queries: int = 0  # full prompt blocks looked up in the prefix cache
    prefix_hits: int = 0  # of those, blocks found
    prefix_hits_by_tier: dict[str, int] = field(default_factory=dict)  # "device", "dram", ...
    preemptions: int = 0
    layer_slices: int = 0  # prompt chunks run a few decoder layers a step beside decodes
    steps: int = 0
    prompt_tokens_computed: int = 0  # prompt (and recomputed) tokens run through the model
    generation_tokens: int = 0
    # speculative decoding: decodes that checked drafts, the drafts checked, those that held
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    failed_requests: int = 0  # requests failed inside the engine (the others went on)
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    tiers: TierStats | None = None  # with a KV store attached
    handoff: HandoffStats | None = None  # on an instance with a prefill or decode role
    load: EngineLoad = EngineLoad()
    step_kinds: dict[str, StepKindStats] = field(default_factory=dict)  # "decode", "mixed", ...

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV blocks in use (0..1)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Drafts that held over drafts checked (0 without speculative decoding)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Block-weighted: hit blocks over looked-up blocks."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
