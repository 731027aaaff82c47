"""Hybrid execution applied to a model: placement rules -> where each unit lives and which
experts backend runs each routed-experts module in each phase.

Who calls it: the loader (`plan_placement` before weights are read, so host experts are
allocated on the host directly), `build_model` and the fine-tuner (`ExpertsBuilder`, per
module as its weights arrive or `build_all` once they are in). `plan_placement` names the
placeable units of a model (embeddings, norms, attention, dense MLPs, routers, routed experts,
shared experts), places them with the rules (`moe/placement.py`) and says where each unit's
weights live; `ExpertsBuilder` gives every routed-experts module one backend per phase, bridges
devices (pinned host buffers when the activations are on CUDA) and keeps the hottest experts of
each layer on the accelerator.

Failure contract: a rule that places a unit where it cannot run is a `PlacementError` naming
the rule and the unit, before any weight is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
from torch import nn

from hetserve.layers.moe import FusedExperts, SparseMoE
from hetserve.moe.experts import ExpertsBackend, ExpertWeights, create_backend
from hetserve.moe.hybrid import DeviceBridge, HotExperts
from hetserve.moe.numa_experts import NumaSplit
from hetserve.moe.placement import PHASES, Placement, PlacementError, PlacementRule, place
from hetserve.moe.routing_stats import RoutingStats, choose_gpu_experts

_LAYER = re.compile(r"layers\.(\d+)\.")
_CPU_BACKENDS = ("cpu-fp32", "cpu-int8", "cpu-int4", "cpu-mxfp4", "cpu-fp8", "cpu-gguf", "kt")
# What `--numa auto` splits: the backends on the native kernel (moe/numa_experts.py).
_NUMA_BACKENDS = ("cpu-fp32", "cpu-int8", "cpu-int4", "cpu-mxfp4", "cpu-fp8")


def placeable_units(model: nn.Module) -> dict[str, nn.Module]:
    units = {
        "model.embed_tokens": model.model.embed_tokens,
        "model.norm": model.model.norm,
        "lm_head": model.lm_head,
    }
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        for name in ("input_layernorm", layer.attn_name, "post_attention_layernorm"):
            units[f"{prefix}.{name}"] = getattr(layer, name)
        mlp = getattr(layer, layer.mlp_name)
        if isinstance(mlp, SparseMoE):
            for child_name, child in mlp.named_children():
                units[f"{prefix}.{layer.mlp_name}.{child_name}"] = child
        else:
            units[f"{prefix}.{layer.mlp_name}"] = mlp
    return units


def unit_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@dataclass
class HybridPlan:
    placement: Placement
    units: dict[str, nn.Module]
    accelerator: torch.device

    def weight_device(self, name: str) -> torch.device:
        """Where a unit's loaded weights live: experts stay on the host when any phase runs
        them there (accelerator copies are made from it); everything else has one device."""
        devices = self.placement.devices_of(name)
        if isinstance(self.units[name], FusedExperts) and "cpu" in devices:
            return torch.device("cpu")
        return torch.device(devices[0])

    def table(self) -> str:
        return self.placement.table({n: unit_bytes(m) for n, m in self.units.items()})


def plan_placement(
    model: nn.Module, rules: list[PlacementRule] | None, accelerator: torch.device
) -> HybridPlan:
    units = placeable_units(model)
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # `device: auto` is the engine's device: a CPU engine on a machine with a GPU (training
    # with experts on the CPU, `--device cpu`) keeps everything else on the CPU too.
    auto = "cpu" if accelerator.type == "cpu" else None
    placement = place(units.keys(), rules, cuda, auto_device=auto)
    for name, module in units.items():
        if not isinstance(module, FusedExperts) and placement.devices_of(name) != [
            str(accelerator)
        ]:
            rule = placement.get(name, "prefill").rule
            raise PlacementError(
                f"placement rule {rule!r}: {name!r} must run on the engine device "
                f"{str(accelerator)!r}; only routed experts can be placed elsewhere"
            )
        if not isinstance(module, FusedExperts) and len(placement.devices_of(name)) > 1:
            rule = placement.get(name, "prefill").rule
            raise PlacementError(
                f"placement rule {rule!r}: only routed experts may change "
                f"device between phases, not {name!r}"
            )
        if not isinstance(module, FusedExperts):
            _check_dense_backend(placement, name)
    return HybridPlan(placement, units, accelerator)


DENSE_BACKENDS = ("cpu-int8",)


def _check_dense_backend(placement: Placement, name: str) -> None:
    """Non-expert units take no backend, or `cpu-int8` (int8 linears) on the CPU, in both
    phases alike."""
    pre, dec = placement.get(name, "prefill"), placement.get(name, "decode")
    backend = dec.backend
    if backend is None and pre.backend is None:
        return
    if backend not in DENSE_BACKENDS or pre.backend != backend or dec.device != "cpu":
        raise PlacementError(
            f"placement rule {dec.rule!r}: backend {backend!r} on {name!r}: non-expert modules "
            "accept only 'cpu-int8' (int8 linears) on device cpu, the same in both phases"
        )


def layer_of(name: str) -> int:
    m = _LAYER.search(name)
    assert m is not None, name
    return int(m.group(1))


def _check_stats_fit(stats: RoutingStats, plan: HybridPlan) -> None:
    """Routing statistics gathered on another model (other MoE layers, other expert counts)
    would pick experts that are not there: a one-line error, not an IndexError mid-load."""
    experts = {layer_of(n): u.num_experts for n, u in plan.units.items()
               if isinstance(u, FusedExperts)}  # fmt: skip
    for layer in stats.layers():
        have, given = experts.get(layer), len(stats.counts(layer))
        if have != given:
            where = f"has {have} experts" if have is not None else "is no MoE layer"
            raise PlacementError(
                f"--routing-stats: layer {layer} counts {given} experts, but in this model it "
                f"{where}: the statistics are another model's; gather this one's with "
                "`hetserve calibrate`"
            )


class ExpertsBuilder:
    """Builds one routed-experts module's backends (one per phase) when called with it: after
    the whole load (`build_all`) or as each module's tensors arrive (the loader's
    `experts_ready`, so the loaded copy is dropped before the next layer is read).
    backend_options: per backend name, extra constructor options (e.g. int4 group size)."""

    def __init__(
        self,
        plan: HybridPlan,
        gpu_experts: int = 0,
        stats: RoutingStats | None = None,
        cpu_threads: int | None = None,
        free_unused: bool = True,
        backend_options: dict | None = None,
        numa: str = "off",
    ) -> None:
        if gpu_experts and stats is None:
            raise PlacementError(
                "--gpu-experts needs routing statistics (hetserve calibrate, or "
                "--routing-stats FILE)"
            )
        if gpu_experts and stats is not None:
            _check_stats_fit(stats, plan)
        self.hot = choose_gpu_experts(stats, gpu_experts) if (gpu_experts and stats) else {}
        self.plan, self.cpu_threads, self.free_unused = plan, cpu_threads, free_unused
        self.options = backend_options or {}
        self.numa = NumaSplit(numa)  # reads the topology; teams start with the first split

    def build_all(self, model: nn.Module) -> None:
        """Every routed-experts module of `model`, once its whole checkpoint is loaded."""
        for name, experts in model.routed_experts():
            self(name, experts)

    def __call__(self, name: str, experts: FusedExperts) -> None:
        built: dict[tuple[str, str], ExpertsBackend] = {}
        by_phase = {}
        hot = self.hot.get(layer_of(name))
        keys = {}
        for phase in PHASES:
            a = self.plan.placement.get(name, phase)
            keys[phase] = (a.device, a.backend or "torch")
        free = self.free_unused and all(k[1] != "torch" for k in keys.values())
        weights = None
        if free and len(set(keys.values())) == 1 and not hot:
            weights = _hand_over(experts)  # one backend: its layout may free what it reads
        for phase, key in keys.items():
            if key not in built:
                built[key] = _make(
                    experts, key[0], key[1], self.plan.accelerator, hot, self.cpu_threads,
                    self.options.get(key[1], {}), self.numa, weights,
                )  # fmt: skip
            by_phase[phase] = built[key]
        experts.set_phase_backends(by_phase)
        if free:
            # Quantized or repacked copies now hold the weights: drop the originals.
            experts.release_weights()


def _hand_over(experts: FusedExperts) -> ExpertWeights | None:
    """The module's packed experts as handed-over weights (ExpertWeights.handed_over: lists
    the backend empties as it lays each expert out), the module's reference dropped; None where
    its experts are not packed (dense weights stay the module's parameters)."""
    weights = experts.weights()
    if weights.packed is None:
        return None
    p = weights.packed
    experts.packed = None
    lists = replace(p, w13=list(p.w13), w2=list(p.w2))
    return replace(weights, packed=lists, handed_over=True)


def _make(
    experts: FusedExperts,
    device: str,
    backend_name: str,
    accelerator: torch.device,
    hot: list[int] | None,
    cpu_threads: int | None,
    extra: dict,
    numa: NumaSplit | None = None,
    weights: ExpertWeights | None = None,
) -> ExpertsBackend:
    dev = torch.device(device)
    weights = weights or experts.weights()
    if weights.device != dev:
        weights = weights.dense(dev)
    split = numa is not None and dev.type == "cpu" and backend_name in _NUMA_BACKENDS
    if cpu_threads is None and dev != accelerator:
        # Host experts beside an accelerator run on the one experts thread (cpu_base.py) even
        # unasked: called from the engine thread (graphs), the overlap thread and the deferral
        # thread in turn, they would otherwise keep an OpenMP team in each, on the same CPUs.
        cpu_threads = torch.get_num_threads()
    # A split layer's shards run on the node teams (numa_experts.Team), not a pool of their own.
    threaded = cpu_threads and backend_name in _CPU_BACKENDS and not (split and numa.active)
    opts = {"num_threads": cpu_threads} if threaded else {}
    opts.update(extra)

    def make(w: ExpertWeights) -> ExpertsBackend:
        return create_backend(backend_name, w, activation=experts.activation, **opts)

    backend = numa.wrap(make, weights) if split else make(weights)
    if dev != accelerator:
        backend = DeviceBridge(backend, dev)
    if hot and (dev != accelerator or backend_name != "torch"):
        # The hottest experts run from the original weights with the reference backend on the
        # engine device (on a CPU-only machine that is the host, in full precision).
        backend = HotExperts(backend, experts.weights(), hot, accelerator, experts.activation)
    return backend
