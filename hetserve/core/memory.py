"""Where host memory goes: the start-up accounting line and the `--max-host-memory` check.

Pure (no I/O, no clock): the engine measures (model/memory_facts.py) and passes the numbers in.
Who calls it: `build_model` checks an estimate made before any weight is read against the limit
(`refusal` returns the one-line reason, the caller raises it as an `InvalidInputError`: exit 2);
`EngineCore` builds the measured `MemoryUse` once the KV cache exists, logs its `line()` and
the server exports `as_metrics()` (hetserve_memory_bytes{part=...}).
"""

from __future__ import annotations

from dataclasses import dataclass

_MIB = 1 << 20
# What the process holds beside weights and KV (interpreter, torch, kernels' buffers, the
# tokenizer) beyond what it had before loading: added to an estimate before the load.
RUNTIME_ALLOWANCE = 300 * _MIB


@dataclass(frozen=True)
class MemoryUse:
    """Host bytes by part. runtime: resident bytes that are none of the others."""

    experts: int
    dense: int
    kv_cache: int
    runtime: int

    @property
    def total(self) -> int:
        return self.experts + self.dense + self.kv_cache + self.runtime

    def line(self) -> str:
        parts = ", ".join(f"{k.replace('_', ' ')} {_mib(v)}" for k, v in self.as_metrics().items())
        return f"host memory: {_mib(self.total)} = {parts}"

    def as_metrics(self) -> dict[str, int]:
        return {
            "experts": self.experts,
            "dense": self.dense,
            "kv_cache": self.kv_cache,
            "runtime": self.runtime,
        }


def refusal(estimate: MemoryUse, limit: int | None) -> str | None:
    """The one-line reason a model estimated at `estimate` does not fit `limit`, else None."""
    if limit is None or estimate.total <= limit:
        return None
    return (
        f"--max-host-memory {_mib(limit)}: this model needs about {_mib(estimate.total)} of "
        f"host memory ({estimate.line().partition(' = ')[2]}); raise the limit, shrink the KV "
        "cache (--kv-cache-gb), or use a smaller format (hetserve convert --quant int4)"
    )


def _mib(n: int) -> str:
    return f"{n / _MIB:.0f} MiB"
