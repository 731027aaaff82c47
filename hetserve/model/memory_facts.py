"""The numbers core/memory.py accounts with: what a placed model will take before any weight is
read (`estimate`, from the meta model and its plan) and what it takes once loaded (`measured`).

Who calls it: `build_model` (the estimate, checked against --max-host-memory) and `EngineCore`
(the measured line, logged and exported on /metrics). Nothing here fails: a part it cannot
size counts at its parameters' bytes.
"""

from __future__ import annotations

from torch import nn

from hetserve.core.memory import RUNTIME_ALLOWANCE, MemoryUse
from hetserve.layers.int8_linear import kept_precise
from hetserve.layers.moe import FusedExperts

# Bytes per weight each experts backend stores (scales included, rounded up).
_EXPERT_BYTES = {
    "cpu-int8": 1.02,
    "cpu-int4": 0.57,
    "cpu-mxfp4": 0.54,
    "cpu-fp8": 1.02,
    "cpu-gguf": 1.07,  # q8_0; the 4- to 6-bit types take less
    "kt": 1.02,
    "cpu-fp32": 4.0,
}


def proc_memory(keys: tuple[str, ...] = ("VmRSS", "VmHWM")) -> dict[str, int]:
    """Those lines of /proc/self/status (resident set, peak, ...) in bytes; none where /proc is
    not there."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in keys:
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def rss_bytes() -> int:
    """This process's resident set (VmRSS), 0 where /proc is not there."""
    return proc_memory(("VmRSS",)).get("VmRSS", 0)


def _own_bytes(module: nn.Module) -> int:
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


def estimate(model: nn.Module, kv_bytes: int, baseline_rss: int) -> MemoryUse:
    """Host bytes of `model` (on the meta device, `model.hybrid_plan` set or None) as it will
    be served, with `kv_bytes` of KV cache, in a process now at `baseline_rss`."""
    plan = getattr(model, "hybrid_plan", None)
    dtype_size = next(model.parameters()).element_size()
    experts = dense = 0
    for name, module in model.named_modules():
        if isinstance(module, FusedExperts):
            n = 3 * module.num_experts * module.hidden_size * module.intermediate_size
            backend = plan.placement.get(name, "decode").backend if plan is not None else None
            experts += int(n * _EXPERT_BYTES.get(backend or "", dtype_size))
            continue
        own = sum(t.numel() for t in module.parameters(recurse=False))
        per = dtype_size
        if plan is not None and isinstance(module, nn.Linear):
            unit = _unit_of(name, plan.units)
            if unit is not None and plan.placement.get(unit, "decode").backend == "cpu-int8":
                parent, _, attr = name.rpartition(".")
                owner = model.get_submodule(parent)
                # an int8 residual beside the int8 rows (layers/int8_linear.py)
                per = 2 if kept_precise(owner, attr) else 1
                # MLA decode's absorbed copy: fp16 on the native kernels (model/deepseek.py)
                per += 2 if attr in getattr(owner, "absorbed_projections", ()) else 0
        dense += own * per
    return MemoryUse(experts, dense, kv_bytes, baseline_rss + RUNTIME_ALLOWANCE)


def _unit_of(name: str, units: dict) -> str | None:
    while name:
        if name in units:
            return name
        name = name.rpartition(".")[0]
    return None


def measured(model: nn.Module, kv_bytes: int) -> MemoryUse:
    """What the loaded model holds: experts (their backends' copies and any weights kept),
    dense (everything else), the KV cache, and the rest of the resident set."""
    experts = dense = 0
    for module in model.modules():
        if isinstance(module, FusedExperts):
            backends = {id(b): b for b in (module._phase_backends or {}).values()}
            if module._backend is not None:
                backends[id(module._backend)] = module._backend
            experts += _own_bytes(module) + sum(_nbytes(b) for b in backends.values())
            continue
        dense += _own_bytes(module) + _nbytes(module)
    runtime = max(rss_bytes() - experts - dense - kv_bytes, 0)
    return MemoryUse(experts, dense, kv_bytes, runtime)


def _nbytes(obj: object) -> int:
    """Bytes an object keeps outside its parameters: its `nbytes`, an attribute (an int8
    linear's packed matrix) or a method (a backend, a LoRA slot's stacked adapters)."""
    size = getattr(obj, "nbytes", None)
    if callable(size):
        size = size()
    return int(size) if isinstance(size, int | float) else 0
