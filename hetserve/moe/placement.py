"""Placement rules as data: which module runs where, with which experts backend, in which phase.

A rules file (YAML) is a list of rules, tried in order; for each module and phase the first rule
that matches wins:

    rules:
      - name: routed-experts            # used in every error message
        match: 'model\\.layers\\.(\\d+)\\.mlp\\.experts'   # re.fullmatch on the module name
        layers: [3, 26]                 # optional, inclusive; the layer is the first (\\d+) group
        device: cpu                     # cpu | cuda | cuda:N | auto (CUDA if present, else CPU)
        backend: cpu-int8               # optional; a name from the experts registry
        phase: both                     # prefill | decode | both (default)
        optional: false                 # true: matching nothing is not an error
      - name: rest
        match: '.*'
        device: auto

This module knows module names and byte counts only, never model classes: the loader passes the
names it has and applies the result.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hetserve.errors import HetserveError
from hetserve.moe.routing_stats import RoutingStats, choose_gpu_experts

__all__ = [
    "Assignment",
    "Placement",
    "PlacementError",
    "PlacementRule",
    "RoutingStats",
    "choose_gpu_experts",
    "default_rules",
    "load_rules",
    "parse_rules",
    "place",
]

PHASES = ("prefill", "decode")
_DEVICE_RE = re.compile(r"cpu|auto|cuda(:\d+)?")
# Backends that compute on the host whatever the rule's device says would be a contradiction.
_CPU_ONLY_BACKENDS = ("cpu-fp32", "cpu-int8", "cpu-int4", "cpu-mxfp4", "cpu-fp8", "cpu-gguf", "kt")


class PlacementError(HetserveError, ValueError):
    """A placement rule or rules file is invalid, or the rules do not place every module."""


@dataclass(frozen=True)
class PlacementRule:
    name: str
    match: str
    device: str = "auto"
    backend: str | None = None
    phase: str = "both"
    layers: tuple[int, int] | None = None
    optional: bool = False

    def __post_init__(self) -> None:
        where = f"placement rule {self.name!r}"
        try:
            pattern = re.compile(self.match)
        except re.error as exc:
            raise PlacementError(f"{where}: bad regex {self.match!r}: {exc}") from None
        object.__setattr__(self, "_pattern", pattern)
        if not _DEVICE_RE.fullmatch(self.device):
            raise PlacementError(
                f"{where}: unknown device {self.device!r}; use cpu, cuda, cuda:N or auto"
            )
        if self.phase not in (*PHASES, "both"):
            raise PlacementError(f"{where}: phase {self.phase!r} must be prefill, decode or both")
        if self.backend is not None:
            from hetserve.moe.experts import available_backends  # registry loads torch

            if self.backend not in available_backends():
                raise PlacementError(
                    f"{where}: unknown experts backend {self.backend!r}; "
                    f"available: {', '.join(available_backends())}"
                )
            if self.backend in _CPU_ONLY_BACKENDS and self.device.startswith("cuda"):
                raise PlacementError(
                    f"{where}: backend {self.backend!r} runs on cpu, not on {self.device!r}"
                )
        if self.layers is not None:
            if pattern.groups < 1:
                raise PlacementError(f"{where}: 'layers' needs a (\\d+) group in 'match'")
            lo, hi = self.layers
            if lo > hi or lo < 0:
                raise PlacementError(f"{where}: layers [{lo}, {hi}] is not a valid range")

    @property
    def phases(self) -> tuple[str, ...]:
        return PHASES if self.phase == "both" else (self.phase,)

    def matches(self, module: str) -> bool:
        m = self._pattern.fullmatch(module)  # type: ignore[attr-defined]
        if m is None:
            return False
        if self.layers is None:
            return True
        group = m.group(1)
        if group is None or not group.isdigit():
            return False
        return self.layers[0] <= int(group) <= self.layers[1]


def default_rules(expert_backend: str = "cpu-int8") -> list[PlacementRule]:
    """Routed experts on CPU with `expert_backend` (cpu-int8, or the backend of the format a
    checkpoint publishes its experts in); everything else on the accelerator (or CPU)."""
    return [
        PlacementRule(
            name="routed-experts",
            match=r"(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts",
            device="cpu",
            backend=expert_backend,
            optional=True,  # dense models have none
        ),
        PlacementRule(name="everything-else", match=r".*", device="auto"),
    ]


_RULE_KEYS = {"name", "match", "device", "backend", "phase", "layers", "optional"}


def parse_rules(data: object, source: str = "<rules>") -> list[PlacementRule]:
    """Rules from parsed YAML: a mapping with a `rules` list, or the list itself."""
    if isinstance(data, Mapping):
        data = data.get("rules")
    if not isinstance(data, list) or not data:
        raise PlacementError(f"{source}: expected a non-empty list of rules under 'rules:'")
    rules = []
    for i, item in enumerate(data):
        label = f"{source}: rule #{i + 1}"
        if not isinstance(item, Mapping) or "match" not in item:
            raise PlacementError(f"{label}: each rule is a mapping with at least 'match'")
        unknown = set(item) - _RULE_KEYS
        if unknown:
            raise PlacementError(f"{label}: unknown keys {sorted(unknown)}")
        layers = item.get("layers")
        if layers is not None:
            if isinstance(layers, int):
                layers = (layers, layers)
            elif (
                isinstance(layers, list)
                and len(layers) == 2
                and all(isinstance(v, int) for v in layers)
            ):
                layers = (layers[0], layers[1])
            else:
                raise PlacementError(f"{label}: 'layers' is an int or [first, last]")
        rules.append(
            PlacementRule(
                name=str(item.get("name", f"#{i + 1}")),
                match=str(item["match"]),
                device=str(item.get("device", "auto")),
                backend=item.get("backend"),
                phase=str(item.get("phase", "both")),
                layers=layers,
                optional=bool(item.get("optional", False)),
            )
        )
    return rules


def load_rules(path: str | Path) -> list[PlacementRule]:
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise PlacementError(f"cannot read placement rules {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise PlacementError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    return parse_rules(data, source=str(path))


@dataclass(frozen=True)
class Assignment:
    device: str  # resolved: "cpu", "cuda", "cuda:N"
    backend: str | None
    rule: str


@dataclass(frozen=True)
class Placement:
    """module name -> phase -> Assignment, for every module and both phases."""

    assignments: dict[str, dict[str, Assignment]]

    def get(self, module: str, phase: str = "decode") -> Assignment:
        return self.assignments[module][phase]

    def devices_of(self, module: str) -> list[str]:
        return sorted({a.device for a in self.assignments[module].values()})

    def bytes_per_device(self, module_bytes: Mapping[str, int]) -> dict[str, int]:
        """A module placed on two devices (one per phase) counts on both: it is resident twice."""
        total: dict[str, int] = {}
        for module in self.assignments:
            for dev in self.devices_of(module):
                total[dev] = total.get(dev, 0) + int(module_bytes.get(module, 0))
        return total

    def table(self, module_bytes: Mapping[str, int] | None = None) -> str:
        """What is where: a row per (device, backend, phase, rule), then bytes per device."""
        module_bytes = module_bytes or {}
        groups: dict[tuple[str, str, str, str], list[int]] = {}
        for module, by_phase in self.assignments.items():
            same = by_phase["prefill"] == by_phase["decode"]
            for phase, a in by_phase.items():
                if same and phase == "decode":
                    continue
                key = (a.device, a.backend or "-", "both" if same else phase, a.rule)
                g = groups.setdefault(key, [0, 0])
                g[0] += 1
                g[1] += int(module_bytes.get(module, 0))
        header = ("device", "backend", "phase", "rule", "modules", "bytes")
        rows = [(*k, str(v[0]), _human(v[1])) for k, v in sorted(groups.items())]
        rows += [
            ("total " + d, "", "", "", "", _human(b))
            for d, b in sorted(self.bytes_per_device(module_bytes).items())
        ]
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in (header, *rows)
        )


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def resolve_device(device: str, cuda_device_count: int, auto: str | None = None) -> str | None:
    """`auto` -> the engine's device where given (`auto`), else cuda or cpu; None when the
    device does not exist on this machine."""
    if device == "auto":
        return auto or ("cuda" if cuda_device_count > 0 else "cpu")
    if device == "cpu":
        return device
    index = int(device.split(":")[1]) if ":" in device else 0
    return device if index < cuda_device_count else None


def place(
    modules: Iterable[str],
    rules: list[PlacementRule] | None = None,
    cuda_device_count: int | None = None,
    auto_device: str | None = None,
) -> Placement:
    """Apply `rules` (default: `default_rules()`) to module names; `auto_device`: what a rule's
    `device: auto` means (the engine's device; default cuda where there is one, else cpu).
    Raises PlacementError naming the rule for a rule that matches nothing or a device that
    does not exist, and naming the module for one left unplaced."""
    if rules is None:
        rules = default_rules()
    if cuda_device_count is None:
        import torch

        cuda_device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [r.name for r in rules]
    for name in names:
        if names.count(name) > 1:
            raise PlacementError(f"placement rule name {name!r} is used by more than one rule")
    assignments: dict[str, dict[str, Assignment]] = {}
    used: set[str] = set()
    for module in modules:
        by_phase: dict[str, Assignment] = {}
        for phase in PHASES:
            for rule in rules:
                if phase in rule.phases and rule.matches(module):
                    device = resolve_device(rule.device, cuda_device_count, auto_device)
                    if device is None:
                        raise PlacementError(
                            f"placement rule {rule.name!r}: device {rule.device!r} does not "
                            f"exist here ({cuda_device_count} CUDA devices)"
                        )
                    by_phase[phase] = Assignment(device, rule.backend, rule.name)
                    used.add(rule.name)
                    break
            else:
                raise PlacementError(
                    f"module {module!r} is left unplaced for phase {phase!r}: no rule matches it "
                    "(add a catch-all rule such as match: '.*')"
                )
        assignments[module] = by_phase
    for rule in rules:
        if rule.name not in used and not rule.optional:
            raise PlacementError(
                f"placement rule {rule.name!r} (match {rule.match!r}) matches no module"
            )
    return Placement(assignments)
