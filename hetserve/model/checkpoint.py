"""A safetensors checkpoint as a stream of logical weights.

`scan` reads only the headers (names and dtypes) of every shard and lets the checkpoint's
format (quant/checkpoint) sort each name into an ordinary tensor or a part of a quantized weight,
so nothing is read before every name is understood and every quantized weight is complete.
`SafetensorsCheckpoint.tensors` then reads shard by shard, one tensor at a time (plain reads
into each tensor's own buffer, or with `reuse` an ordinary tensor into one reused buffer:
model/st_file.py), and yields each quantized weight once all its parts have been read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hetserve.errors import MissingTensorError, ModelLoadError
from hetserve.model.st_file import SafetensorsFile, Scratch
from hetserve.quant.checkpoint import CheckpointFormat
from hetserve.quant.packed import QMatrix

Value = torch.Tensor | QMatrix


def checkpoint_files(model_dir: Path, exclude: tuple[str, ...] = ()) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index.name} names missing shard(s) {missing}; re-download them")
        return files
    files = sorted(f for f in model_dir.glob("*.safetensors") if f.name not in exclude)
    if not files:
        raise ModelLoadError(f"no *.safetensors in {str(model_dir)!r}; convert the weights first")
    return files


@dataclass
class SafetensorsCheckpoint:
    files: list[Path]
    fmt: CheckpointFormat
    # stored name -> (logical name, role) for parts of quantized weights
    parts: dict[str, tuple[str, str]] = field(default_factory=dict)
    roles: dict[str, set[str]] = field(default_factory=dict)  # logical name -> roles present

    @classmethod
    def scan(
        cls, model_dir: Path, fmt: CheckpointFormat, exclude: tuple[str, ...] = ()
    ) -> SafetensorsCheckpoint:
        """`exclude`: file names that are not part of the checkpoint (converted experts)."""
        ckpt = cls(checkpoint_files(model_dir, exclude), fmt)
        for path in ckpt.files:
            with SafetensorsFile(path) as f:
                for name in f.keys():
                    part = fmt.part_of(name, f.dtype(name))
                    if part is not None:
                        ckpt.parts[name] = part
                        ckpt.roles.setdefault(part[0], set()).add(part[1])
        for logical, roles in ckpt.roles.items():
            missing = set(fmt.required_roles(logical)) - roles
            if missing:
                raise MissingTensorError(
                    f"quantized weight {logical!r} lacks its {', '.join(sorted(missing))} "
                    f"tensor(s) ({fmt.method}); the checkpoint is incomplete"
                )
        return ckpt

    @property
    def packed_fmt(self) -> str | None:
        """The QMatrix format of its quantized weights (the experts' backend follows it)."""
        return self.fmt.packed_fmt

    def quantized_names(self) -> set[str]:
        """Logical names of the weights stored quantized."""
        return set(self.roles)

    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def tensors(
        self, wanted: Callable[[str], bool], reuse: bool = False
    ) -> Iterator[tuple[str, Value, int]]:
        """(logical name, value, bytes read) for every wanted weight, in file order. With
        `reuse`, an ordinary tensor may be a view of a buffer the next read overwrites (the
        caller copies or rounds each before it asks for the next; st_file.Scratch); the parts
        of a quantized weight always have buffers of their own."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        scratch = Scratch() if reuse else None
        for path in self.files:
            with SafetensorsFile(path) as f:
                for name in f.keys():
                    part = self.parts.get(name)
                    logical = name if part is None else part[0]
                    if not wanted(logical):
                        continue
                    t = f.read(name, scratch if part is None else None)
                    if part is None:
                        yield name, t, t.nbytes
                        continue
                    got = pending.setdefault(logical, {})
                    got[part[1]] = t
                    if set(got) == self.roles[logical]:
                        del pending[logical]
                        yield (
                            logical,
                            self.fmt.decode(logical, got),
                            sum(v.nbytes for v in got.values()),
                        )
