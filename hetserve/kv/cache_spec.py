"""What each layer of a model keeps between forwards: one cache spec per layer kind.

Who reads it: the engine (sizing memory, `engine/setup.py`), the runner (allocating the paged KV
and the state cache), the KV manager (whether requests need state slots). A model says what its
layers keep with `CausalLM.cache_specs()`; nothing here allocates or knows torch.

Two kinds of memory:
  * Paged, per token (`PagedLayerSpec`): full attention (K and V per KV head), sliding-window
    attention, MLA (one compressed row), MLA with DeepSeek-V3.2's indexer (the row plus the
    indexer's key). They live in the paged KV blocks and share the block tables.
  * Per sequence, fixed size (`StateLayerSpec`): a linear-attention layer's recurrent state
    (its short-convolution window and its delta-rule state). It does not grow with the
    context; it lives in state slots (`kv/state.py`), one per running request, plus the
    checkpoints that prefix caching keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from math import prod

Shape = tuple[int, ...]


class LayerKind(StrEnum):
    ATTENTION = "attention"
    SLIDING_WINDOW = "sliding_window"
    MLA = "mla"
    MLA_INDEXED = "mla_indexed"  # MLA rows + the lightning indexer's keys (DeepSeek-V3.2)
    LINEAR_STATE = "linear_state"


@dataclass(frozen=True)
class PagedLayerSpec:
    kind: LayerKind
    entries: tuple[Shape, ...]  # the shape of one token's entry in each of the layer's tensors
    window: int | None = None  # sliding window (tokens); None: the whole context

    def slot_elements(self) -> int:
        return sum(prod(s) for s in self.entries)


@dataclass(frozen=True)
class StateLayerSpec:
    entries: tuple[Shape, ...]  # the shape of one sequence's state in each tensor
    kind: LayerKind = LayerKind.LINEAR_STATE

    def slot_elements(self) -> int:
        return sum(prod(s) for s in self.entries)


LayerCacheSpec = PagedLayerSpec | StateLayerSpec


def paged_layout(specs: list[LayerCacheSpec]) -> list[list[Shape]]:
    """Per layer, the paged entries (a state layer has none): the layout `PagedKVCache` takes."""
    return [list(s.entries) if isinstance(s, PagedLayerSpec) else [] for s in specs]


def state_layout(specs: list[LayerCacheSpec]) -> list[list[Shape]]:
    """Per layer, the per-sequence state entries (a paged layer has none)."""
    return [list(s.entries) if isinstance(s, StateLayerSpec) else [] for s in specs]


def has_state(specs: list[LayerCacheSpec]) -> bool:
    return any(isinstance(s, StateLayerSpec) for s in specs)


def state_slot_bytes(specs: list[LayerCacheSpec], elem_bytes: int = 4) -> int:
    """Bytes of one state slot over all layers (states are kept in fp32)."""
    return elem_bytes * sum(s.slot_elements() for s in specs if isinstance(s, StateLayerSpec))


def describe(specs: list[LayerCacheSpec]) -> str:
    """One line: how many layers of each kind, e.g. 'linear_state x36, attention x12'."""
    counts: dict[str, int] = {}
    for s in specs:
        counts[s.kind.value] = counts.get(s.kind.value, 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in counts.items())
