"""Routing statistics: how often each expert of each MoE layer was chosen, and the hot experts.

File format (JSON, written by `RoutingStats.save`, read by `RoutingStats.load`):

    {"version": 1,
     "layers": {"3": [count of expert 0, count of expert 1, ...], "4": [...]},
     "tokens": {"3": 1024, "4": 1024}}

Only "layers" is required; a layer's list has one non-negative integer per expert. Keys are layer
indices as strings (JSON has no integer keys). `tokens` counts the tokens seen per layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hetserve.errors import InvalidInputError

STATS_VERSION = 1


class RoutingStats:
    """Accumulates per-layer expert counts. `add` keeps the counts on the ids' device, so
    calling it every forward adds no host sync; `to_dict`/`save` copy them to the host."""

    def __init__(self) -> None:
        self._counts: dict[int, torch.Tensor] = {}
        self._tokens: dict[int, int] = {}

    def add(self, layer: int, topk_ids: torch.Tensor, num_experts: int | None = None) -> None:
        flat = topk_ids.reshape(-1)
        prev = self._counts.get(layer)
        size = max(num_experts or 0, prev.numel() if prev is not None else 0)
        counts = torch.bincount(flat, minlength=size)
        if prev is not None:
            if prev.device != counts.device:
                prev = prev.to(counts.device)
            if counts.numel() > prev.numel():  # an expert id above what was seen so far
                prev = torch.nn.functional.pad(prev, (0, counts.numel() - prev.numel()))
            counts = counts + prev
        self._counts[layer] = counts
        self._tokens[layer] = self._tokens.get(layer, 0) + int(topk_ids.shape[0])

    def layers(self) -> list[int]:
        return sorted(self._counts)

    def counts(self, layer: int) -> list[int]:
        return self._counts[layer].tolist()

    def to_dict(self) -> dict:
        return {
            "version": STATS_VERSION,
            "layers": {str(layer): self.counts(layer) for layer in self.layers()},
            "tokens": {str(layer): self._tokens.get(layer, 0) for layer in self.layers()},
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()) + "\n")

    @classmethod
    def from_dict(cls, data: object, source: str = "<stats>") -> RoutingStats:
        layers = data.get("layers") if isinstance(data, dict) else None
        if not isinstance(layers, dict):
            raise InvalidInputError(f"{source}: routing stats need a 'layers' mapping")
        stats = cls()
        tokens = data.get("tokens") or {}
        for key, counts in layers.items():
            if not str(key).isdigit():
                raise InvalidInputError(f"{source}: layer key {key!r} is not a layer index")
            if not isinstance(counts, list) or not all(
                isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts
            ):
                raise InvalidInputError(
                    f"{source}: layer {key}: counts must be a list of non-negative integers"
                )
            stats._counts[int(key)] = torch.tensor(counts, dtype=torch.int64)
            stats._tokens[int(key)] = int(tokens.get(str(key), 0))
        return stats

    @classmethod
    def load(cls, path: str | Path) -> RoutingStats:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise InvalidInputError(f"cannot read routing stats {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{path}: routing stats are not valid JSON ({exc})") from None
        return cls.from_dict(data, source=str(path))


def choose_gpu_experts(stats: RoutingStats, n: int) -> dict[int, list[int]]:
    """The `n` most-routed experts of each layer (ties: lower expert id first), sorted by id.
    `n` larger than a layer's expert count keeps all of them."""
    if n < 0:
        raise InvalidInputError(f"--gpu-experts must be >= 0, got {n}")
    chosen: dict[int, list[int]] = {}
    for layer in stats.layers():
        counts = stats.counts(layer)
        ranked = sorted(range(len(counts)), key=lambda e: (-counts[e], e))
        chosen[layer] = sorted(ranked[:n])
    return chosen
