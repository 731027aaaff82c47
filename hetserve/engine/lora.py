"""LoRAManager: the adapters an engine serves, and which of them sit in the layers' slots.

Who calls it: `EngineCore` builds it (installing `LoRALinear` around every linear of the model
but the LM head) and loads the configured adapters; `load`/`unload`/`resolve` may be called from
any thread (the server's load/unload endpoints, request validation); `activate` and `collect`
only from the engine thread, between forwards.

Adapters live in host memory once loaded (`load` reads and checks the directory against the
model: module names, shapes, `max_lora_rank`). `max_loras` of them are resident in the slots; a
step that needs one that is not takes the least recently used slot no request of that step needs.
An adapter is identified by its content id (engine requests carry it, and it is in every block
hash of their KV): unloading a name only forgets the name; the weights go once no live request
uses them (`collect`), and loading the same files again gives the same id (and prefix hits).

Failure contract: every user mistake is a one-line `ModelLoadError` (the adapter directory) or
`InvalidInputError` (a name); nothing is registered when loading fails.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from hetserve.config import LoRAConfig
from hetserve.errors import InvalidInputError, ModelLoadError
from hetserve.layers.lora import LoRABatch, LoRALinear
from hetserve.model.lora_adapter import LoRAAdapter, read_adapter


def install_lora_layers(
    model: nn.Module, batch: LoRABatch, max_loras: int, max_rank: int
) -> dict[str, tuple[LoRALinear, int]]:
    """Wrap every linear (nn.Linear or Int8Linear; not the LM head) in a LoRALinear. Returns HF
    module name -> (layer, part): a fused q/k/v matrix is one layer with three parts."""
    from hetserve.layers.int8_linear import Int8Linear

    param = next(model.parameters(), None)
    dtype = torch.float32 if param is None else param.dtype
    targets: dict[str, tuple[LoRALinear, int]] = {}
    for prefix, parent in list(model.named_modules()):
        if isinstance(parent, LoRALinear):
            continue
        declared = getattr(parent, "fused_projections", None)
        fused = declared() if declared else {}
        for name, child in list(parent.named_children()):
            full = f"{prefix}.{name}" if prefix else name
            if full == "lm_head" or not isinstance(child, nn.Linear | Int8Linear):
                continue
            if name in fused:
                sizes = parent.fused_sizes()
                parts = [(p, sizes[p]) for p in fused[name]]
            else:
                parts = [(name, child.out_features)]
            if isinstance(child, nn.Linear):
                device, layer_dtype = child.weight.device, child.weight.dtype
            else:  # int8 linears run on the host and return the activations' dtype
                device, layer_dtype = torch.device("cpu"), dtype
            layer = LoRALinear(
                child, parts, child.in_features, max_loras, max_rank, batch, device, layer_dtype
            )
            setattr(parent, name, layer)
            for j, (part, _) in enumerate(parts):
                targets[f"{prefix}.{part}" if prefix else part] = (layer, j)
    return targets


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig) -> None:
        self.max_loras, self.max_rank = config.max_loras, config.max_lora_rank
        self.batch = LoRABatch()
        self.targets = install_lora_layers(model, self.batch, self.max_loras, self.max_rank)
        # Each layer with the HF names of its parts, in part order.
        self.layers: dict[LoRALinear, list[str]] = {}
        for name, (layer, _) in self.targets.items():
            self.layers.setdefault(layer, []).append(name)
        self._lock = threading.Lock()
        self._adapters: dict[str, LoRAAdapter] = {}  # content id -> adapter
        self._names: dict[str, str] = {}  # name -> content id
        self._paths: dict[str, str] = {}  # name -> the directory it was loaded from
        self._slots: OrderedDict[str, int] = OrderedDict()  # id -> slot, least recent first
        self._free = list(range(self.max_loras - 1, -1, -1))
        self.retired: set[str] = set()  # ids no name refers to (dropped once unused)

    # ---- any thread ---------------------------------------------------------------------------
    def load(self, name: str, path: str | Path, replace: bool = False) -> str:
        """Read, check and register an adapter under `name`; returns its content id."""
        if not name:
            raise InvalidInputError("a LoRA adapter needs a non-empty name", param="lora_name")
        with self._lock:
            self._check_free(name, replace)
        adapter = read_adapter(path)  # outside the lock: file reads take a while
        self._check(adapter)
        with self._lock:
            self._check_free(name, replace)  # a concurrent load may have taken it meanwhile
            adapter = self._adapters.setdefault(adapter.id, adapter)
            old = self._names.get(name)
            self._names[name], self._paths[name] = adapter.id, str(path)
            self.retired.discard(adapter.id)
            if old is not None and old != adapter.id and old not in self._names.values():
                self.retired.add(old)
        return adapter.id

    def _check_free(self, name: str, replace: bool) -> None:
        if name in self._names and not replace:
            raise InvalidInputError(
                f"LoRA adapter {name!r} is already loaded; unload it first", param="lora_name"
            )

    def unload(self, name: str) -> None:
        with self._lock:
            if name not in self._names:
                raise InvalidInputError(f"LoRA adapter {name!r} is not loaded", param="lora_name")
            lora_id = self._names.pop(name)
            self._paths.pop(name)
            if lora_id not in self._names.values():
                self.retired.add(lora_id)

    def resolve(self, name: str) -> str:
        """The content id of the adapter loaded under `name`."""
        with self._lock:
            lora_id = self._names.get(name)
        if lora_id is None:
            known = ", ".join(sorted(self._names)) or "none"
            raise InvalidInputError(
                f"LoRA adapter {name!r} is not loaded (loaded: {known})", param="model"
            )
        return lora_id

    def has(self, lora_id: str) -> bool:
        with self._lock:
            return lora_id in self._adapters

    def adapters(self) -> dict[str, str]:
        """Loaded adapter names -> the directories they came from."""
        with self._lock:
            return dict(self._paths)

    def ids(self) -> dict[str, str]:
        """Loaded adapter names -> their content ids (in their requests' block hashes)."""
        with self._lock:
            return dict(self._names)

    def _check(self, adapter: LoRAAdapter) -> None:
        where = f"LoRA adapter {str(adapter.path)!r}"
        if adapter.rank > self.max_rank:
            raise ModelLoadError(
                f"{where} has rank {adapter.rank}, above max_lora_rank {self.max_rank}; "
                f"raise it (--max-lora-rank {adapter.rank})"
            )
        for name, w in adapter.modules.items():
            if name not in self.targets:
                leaves = sorted({t.rpartition(".")[2] for t in self.targets})
                raise ModelLoadError(
                    f"{where} targets {name}, which this model does not have as a linear layer "
                    f"(LoRA can target: {', '.join(leaves)}); was it trained for another model?"
                )
            layer, j = self.targets[name]
            want = layer.part_features(j)
            if (w.a.shape[1], w.b.shape[0]) != want:
                raise ModelLoadError(
                    f"{where}: {name} maps {w.a.shape[1]} -> {w.b.shape[0]} features but the "
                    f"model's maps {want[0]} -> {want[1]}; was it trained for another model?"
                )

    # ---- engine thread ------------------------------------------------------------------------
    def batches(self, lora_ids: Sequence[str | None]) -> list[list[int]]:
        """Split a step's sequences (their adapter ids, None = base) into forwards of at most
        `max_loras` adapters each, every forward's indices ordered by adapter so each adapter's
        tokens are one contiguous run (the LoRA layers' segments)."""
        distinct = list(dict.fromkeys(i for i in lora_ids if i is not None))
        if not distinct:
            return [list(range(len(lora_ids)))]
        group_of = {lora_id: n // self.max_loras for n, lora_id in enumerate(distinct)}
        groups: list[list[int]] = [[] for _ in range(max(1, -(-len(distinct) // self.max_loras)))]
        order = sorted(range(len(lora_ids)), key=lambda i: lora_ids[i] or "")
        for i in order:
            groups[group_of.get(lora_ids[i], 0)].append(i)
        return groups

    def activate(self, lora_ids: Sequence[str]) -> dict[str, int]:
        """Slots holding these adapters (at most `max_loras`), filling free or least recently
        used slots as needed."""
        assert len(lora_ids) <= self.max_loras, "the executor splits larger batches"
        out: dict[str, int] = {}
        for lora_id in lora_ids:
            if lora_id in self._slots:
                self._slots.move_to_end(lora_id)
                out[lora_id] = self._slots[lora_id]
        for lora_id in lora_ids:
            if lora_id in out:
                continue
            if self._free:
                slot = self._free.pop()
            else:
                victim = next(i for i in self._slots if i not in out)
                slot = self._slots.pop(victim)
            with self._lock:
                adapter = self._adapters[lora_id]
            self._fill(slot, adapter)
            self._slots[lora_id] = out[lora_id] = slot
        return out

    def _fill(self, slot: int, adapter: LoRAAdapter | None) -> None:
        for layer, names in self.layers.items():
            layer.set_slot(
                slot, None if adapter is None else [adapter.modules.get(n) for n in names]
            )

    def collect(self, live: set[str | None]) -> None:
        """Drop retired adapters that no live request uses (their slots become free)."""
        with self._lock:
            gone = {i for i in self.retired if i not in live}
            for lora_id in gone:
                self.retired.discard(lora_id)
                self._adapters.pop(lora_id, None)
        for lora_id in gone:
            slot = self._slots.pop(lora_id, None)
            if slot is not None:
                self._fill(slot, None)
                self._free.append(slot)

    def check_integrity(self) -> None:
        slots = list(self._slots.values())
        assert sorted(slots + self._free) == list(range(self.max_loras)), (slots, self._free)
        with self._lock:
            assert set(self._slots) <= set(self._adapters), "a slot holds an unknown adapter"
            assert set(self._names.values()) | self.retired == set(self._adapters)
            assert not self.retired & set(self._names.values())
        for layer in self.layers:
            for slot in self._free:
                assert not layer._filled[slot], "a free slot still holds weights"

    def resident(self) -> dict[str, int]:
        """Adapter ids in the slots (least recently used first) -> slot."""
        return dict(self._slots)


def build_lora_manager(model: nn.Module, config: LoRAConfig) -> LoRAManager | None:
    """LoRA layers and the configured adapters when LoRA is on, else None."""
    if not config.enabled:
        return None
    manager = LoRAManager(model, config)
    for name, path in config.lora_modules:
        manager.load(name, path)
    return manager


def resolve_lora(manager: LoRAManager | None, name: str | None) -> str | None:
    """The content id of the adapter loaded as `name` (None: the base model)."""
    if name is None:
        return None
    if manager is None:
        raise InvalidInputError(
            f"LoRA adapter {name!r} requested but this engine has no LoRA support; start it "
            "with lora_modules (--lora-modules NAME=DIR) or enable_lora",
            param="model",
        )
    return manager.resolve(name)
