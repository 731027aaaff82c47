"""Load a model directory into a family class: checkpoint formats understood before any data
is read (quant/checkpoint), lazy (mmap) safetensors reads, name mapping (model/filler.py), shape
checks, clear errors, a progress bar for large models.

Weights that a checkpoint stores quantized are dequantized into their parameters, except the
routed experts: those stay in the published format (`FusedExperts.packed`) for the CPU expert
backends, so e.g. an FP8 or MXFP4 model never exists in full precision in memory.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm import tqdm

from hetserve.errors import ModelLoadError, ModelNotFoundError
from hetserve.layers.int8_linear import kept_precise
from hetserve.layers.moe import FusedExperts
from hetserve.model.base import CausalLM
from hetserve.model.checkpoint import SafetensorsCheckpoint
from hetserve.model.config import ModelConfig
from hetserve.model.converted import (
    CONFIG_KEY,
    attach_linears,
    is_mapped,
    load_converted_experts,
    open_mapped,
)
from hetserve.model.filler import ExpertsReady, WeightFiller, expert_prefix
from hetserve.model.gguf_file import GgufCheckpoint
from hetserve.model.registry import model_class
from hetserve.moe.experts import PACKED_BACKENDS, default_backend
from hetserve.quant.checkpoint import checkpoint_format
from hetserve.quant.packed import QMatrix

if TYPE_CHECKING:
    from hetserve.model.hybrid_plan import HybridPlan

log = logging.getLogger(__name__)

PROGRESS_MIN_BYTES = 256 << 20
Checkpoint = SafetensorsCheckpoint | GgufCheckpoint


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ModelLoadError(f"unknown device {device!r}; use auto, cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but CUDA is not available; use --device cpu")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    # fp32 on CPU: bf16 matmul is ~100x slower than fp32 on AVX2 CPUs without AMX.
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in table:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return table[dtype]


def open_checkpoint(path: Path) -> tuple[ModelConfig, Checkpoint]:
    """The config and tensors of a model directory, or of a GGUF file (with the config.json
    beside it where there is one, else the config its metadata describes)."""
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {str(path)!r} does not exist")
        ckpt = GgufCheckpoint(path)
        if (path.parent / "config.json").is_file():
            return ModelConfig.from_dir(path.parent), ckpt
        return ModelConfig.from_dict(ckpt.hf_config()), ckpt
    if path.is_file():
        raise ModelNotFoundError(
            f"{str(path)!r} is a file; pass an HF model directory or a .gguf file"
        )
    cfg = ModelConfig.from_dir(path)
    converted = cfg.get(CONFIG_KEY)
    exclude = (converted["file"],) if converted else ()
    fmt = checkpoint_format(cfg.get("quantization_config", "compression_config"))
    return cfg, SafetensorsCheckpoint.scan(path, fmt, exclude)


def _packed_experts(model: CausalLM, ckpt: Checkpoint, filler_probe) -> set[str]:
    """Experts modules whose checkpoint tensors are quantized: they stay packed."""
    packed = set()
    for logical in ckpt.quantized_names():
        name, _ = model.map_checkpoint_tensor(logical, None)
        target = filler_probe(name)
        prefix = expert_prefix(target) if target is not None else None
        if prefix is not None:
            packed.add(prefix)
    return packed


ExpertQuantizer = Callable[["HybridPlan", str], Callable[[torch.Tensor], QMatrix] | None]


def _quantizers(
    model: CausalLM, plan: HybridPlan, packed: set[str], expert_quantizer: ExpertQuantizer
) -> dict[str, Callable[[torch.Tensor], QMatrix]]:
    """The experts modules whose dense tensors are quantized as they arrive, with how (their
    dense weights are then never allocated: `expect_packed`)."""
    out = {}
    for name, experts in model.routed_experts():
        q = None if name in packed else expert_quantizer(plan, name)
        if q is not None:
            experts.expect_packed()
            out[name] = q
    return out


def _allocate(
    model: CausalLM,
    dev: torch.device,
    placement,
    expert_backend: str | None,
    stream: bool,
    before_alloc: Callable[[CausalLM], None] | None = None,
    int8_unallocated: bool = False,
    embeddings_unallocated: bool = False,
):
    """Place units (with `placement`) and allocate every parameter where it will live;
    with `stream`, host experts' w13 and w2 stay unallocated (meta) until their layer is read
    (FusedExperts.materialize), and their backend replaces them before the next layer; with
    `int8_unallocated`, so do the weights of the linears that will be Int8Linears (the filler
    hands them their checkpoint matrices instead: model/filler.py), and with
    `embeddings_unallocated` the token embeddings' (layers/quant_embedding.py)."""
    model.hybrid_plan = None
    if isinstance(placement, str):  # a preset: packed experts keep their format's backend
        from hetserve.moe.presets import preset_rules

        placement = preset_rules(placement, expert_backend or "cpu-int8")  # device: None
    if placement is not None:
        from hetserve.model.hybrid_plan import plan_placement

        plan = plan_placement(model, placement, dev)
        model.hybrid_plan = plan
        if before_alloc is not None:
            before_alloc(model)
        for name, unit in plan.units.items():
            device = plan.weight_device(name)
            if stream and isinstance(unit, FusedExperts) and device.type == "cpu":
                _allocate_biases(unit, device)
                continue
            _to_empty(unit, device)
            if int8_unallocated and plan.placement.get(name).backend is not None:
                _unallocate_linears(unit, embeddings_unallocated)
        model.hybrid_plan = plan
    else:
        if before_alloc is not None:
            before_alloc(model)
        model = _to_empty(model, dev)
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers(dev)
    return model


def _to_empty(module: nn.Module, device: torch.device):
    """`module.to_empty(device=device)` without its empty_like: on a meta tensor that runs
    torch._refs, whose first call imports torch.fx's symbolic shapes and sympy (0.7 s of every
    start-up here); a factory call with the same sizes and strides does not."""
    return module._apply(
        lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
    )


def _unallocate_linears(unit: nn.Module, embeddings: bool = False) -> None:
    """Back to meta: the weights of the linears build.apply_dense_backends makes Int8Linears
    of (a non-expert unit with a backend: the unit itself if it is a linear, else every linear
    in it); never touched, so their pages were never resident. `embeddings`: the token
    embeddings too (a file whose token_embd the loader keeps as it is: quant_embedding.py)."""
    if isinstance(unit, FusedExperts):
        return
    # (parent, name, module) of the unit and everything in it; linears their parent keeps
    # precise are left (the Int8Linear keeps its rounding error: it needs the weight)
    found = [(None, "", unit)]
    found += [(p, n, m) for p in unit.modules() for n, m in p.named_children()]
    for parent, name, m in found:
        if parent is not None and kept_precise(parent, name):
            continue
        if isinstance(m, nn.Linear) or (isinstance(m, nn.Embedding) and embeddings):
            m.weight = nn.Parameter(m.weight.to("meta"), requires_grad=False)


def _allocate_biases(unit: FusedExperts, device: torch.device) -> None:
    for pname in ("b13", "b2"):
        p = getattr(unit, pname)
        if p is not None:
            empty = torch.empty(p.shape, dtype=p.dtype, device=device)
            setattr(unit, pname, nn.Parameter(empty, requires_grad=False))


def load_model(
    model_dir: str | Path,
    device: str = "auto",
    dtype: str = "auto",
    placement=None,
    *,
    expert_backends: bool = True,
    experts_ready: Callable[[HybridPlan, str, FusedExperts], None] | None = None,
    before_alloc: Callable[[CausalLM], None] | None = None,
    int8_linears: bool = False,
    expert_quantizer: ExpertQuantizer | None = None,
    linear_rounding: Callable[[torch.Tensor], QMatrix] | None = None,
) -> CausalLM:
    """Load weights. With `placement` (a list of PlacementRule, or a preset name: "hybrid" /
    "default", "all-int8"; moe/presets.py), units are placed before any memory is allocated, so
    routed experts bound for the host never touch the accelerator; the plan is left on
    `model.hybrid_plan` for the expert backends. With a preset, experts the checkpoint
    publishes quantized get the backend of their format.
    Without placement, each experts module gets its default backend unless `expert_backends`
    is False (callers that only read the weights, e.g. convert).
    `experts_ready(plan, name, module)` (with a placement): called once per routed-experts module as
    soon as its tensors are in, to build its backends; host experts are then read one layer
    at a time and never all exist in full precision (model/build.py passes it).
    `before_alloc(model)`: called on the placed meta model before any memory is allocated
    (the --max-host-memory check raises there).
    `int8_linears`: the caller makes Int8Linears of the linears of every non-expert unit the
    placement gives a backend (build.apply_dense_backends); a GGUF file's then never exist in
    fp32 (each gets its checkpoint matrix as `packed_weight`, its weight left unallocated);
    with `linear_rounding` (how those Int8Linears round a dense weight) a dense checkpoint's
    neither: each such weight is rounded as it is read (but linears their parent keeps precise).
    `expert_quantizer(plan, name)` (a streaming load): for a routed-experts module the checkpoint
    holds dense, a function that quantizes one expert matrix as the backend the plan gives it
    would (None: load it dense); its tensors are then quantized as they are read, and the module
    never holds its dense layer."""
    model_dir = Path(model_dir)
    cfg, ckpt = open_checkpoint(model_dir)
    cls = model_class(cfg.architecture)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    converted = cfg.get(CONFIG_KEY)
    with torch.device("meta"), _no_init():
        model = cls(cfg).to(dt)
    packed = _packed_experts(model, ckpt, WeightFiller(model, set()).target)
    modules = dict(model.named_modules())
    for prefix in packed:
        modules[prefix].expect_packed()
    if is_mapped(converted):  # the experts are the mapped file's bytes: never allocated here
        for _, experts in model.routed_experts():
            experts.expect_packed()
    backend = PACKED_BACKENDS[ckpt.packed_fmt] if packed else None
    stream = experts_ready is not None and placement is not None
    gguf = isinstance(ckpt, GgufCheckpoint)
    int8_unallocated = int8_linears and (gguf or linear_rounding is not None)
    embeddings = gguf and int8_unallocated and ckpt.kept("token_embd.weight")  # type: ignore[union-attr]
    model = _allocate(
        model, dev, placement, backend, stream, before_alloc, int8_unallocated, embeddings
    )
    mapped, elsewhere = None, set()
    if is_mapped(converted):
        mapped = open_mapped(model_dir, converted)
        if int8_unallocated and linear_rounding is not None:  # rounded as the file's were
            elsewhere = attach_linears(model, mapped, dt)
    ready: ExpertsReady | None = None
    quantizers = {}
    if stream:
        plan = model.hybrid_plan
        ready = lambda name, module: experts_ready(plan, name, module)  # noqa: E731
        if expert_quantizer is not None and converted is None:  # converted: their own file
            quantizers = _quantizers(model, plan, packed, expert_quantizer)
    filler = WeightFiller(
        model, packed | set(quantizers), ready, quantizers, linear_rounding, elsewhere
    )
    _fill(model, ckpt, filler, filler.params)
    if isinstance(ckpt, GgufCheckpoint):  # what each tensor type became, in one line
        print(ckpt.summary(), file=sys.stderr, flush=True)
    filler.check_complete(experts_elsewhere=converted is not None)
    filler.finish_packed()
    if converted is not None:
        load_converted_experts(model, model_dir, converted, ready, mapped)
    return _finish(model, expert_backends)


_INITS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_",
          "xavier_uniform_", "xavier_normal_", "zeros_", "ones_", "constant_")  # fmt: skip


@contextlib.contextmanager
def _no_init():
    """Modules built on meta skip their random initialisation (the checkpoint replaces every
    value): torch runs an initializer on a meta tensor through its Python reference ops, whose
    first use imports torch._dynamo, 1.5-6 s of start-up on the 2-core VM."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _fill(model: CausalLM, ckpt: Checkpoint, filler: WeightFiller, params: dict) -> None:
    def target(logical: str) -> str | None:
        return filler.target(model.map_checkpoint_tensor(logical, None)[0])

    def wanted(logical: str) -> bool:
        return target(logical) is not None

    def int8(logical: str) -> bool:  # an int8 linear's weight: left unallocated (_allocate)
        name = target(logical)
        return name is not None and name in params and params[name].is_meta

    total = ckpt.nbytes()
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading weights",
               disable=total < PROGRESS_MIN_BYTES)  # fmt: skip
    with bar:
        read = ckpt.tensors(wanted, int8) if isinstance(ckpt, GgufCheckpoint) else None
        # the filler copies or rounds each tensor before the next is read: one read buffer
        for logical, value, nbytes in read or ckpt.tensors(wanted, reuse=True):
            name, value = model.map_checkpoint_tensor(logical, value)
            filler.fill(filler.target(name), value, logical)
            bar.update(nbytes)


def _finish(model: CausalLM, expert_backends: bool) -> CausalLM:
    if model.config.tie_word_embeddings:
        model.tie_weights()
    model.eval().requires_grad_(False)
    if model.hybrid_plan is None and expert_backends:
        for _, experts in model.routed_experts():
            packed = experts.packed is not None or experts.layout is not None
            experts.set_backend(default_backend(experts.weights(), experts.activation))
            if packed and experts.backend_name != "torch":
                experts.release_weights()  # the backend holds its own copy, in its layout
    return model
