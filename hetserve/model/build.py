"""build_model(config): everything between an EngineConfig and a ready model.

Called once by the engine at start-up (and by tools that need the served model as the engine
would build it). It loads the weights with the placement the config
asks for (or the one a converted checkpoint implies), builds the routed-expert backends, turns on
expert deferral and routing statistics. Errors are `ModelLoadError` / `InvalidInputError` with
one-line messages; nothing is half-built on failure (the caller simply has no model).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hetserve.config import EngineConfig, MoEConfig
from hetserve.errors import InvalidInputError
from hetserve.model.base import CausalLM
from hetserve.model.config import read_config_json
from hetserve.model.load_heap import copies_unmapped, heap_reused, trim_heap
from hetserve.model.loader import load_model
from hetserve.moe.presets import PlacementChoice

if TYPE_CHECKING:
    from hetserve.model.hybrid_plan import HybridPlan

log = logging.getLogger(__name__)


def build_model(config: EngineConfig, model_dir: Path) -> CausalLM:
    """The model of `model_dir` (the directory `config.model` names, resolved by the caller:
    the engine resolves the demo default) as `config` asks for it."""
    if model_dir.suffix != ".gguf":
        return _build_model(config, model_dir, False)
    with copies_unmapped() as unmapped:
        return _build_model(config, model_dir, unmapped)


def _build_model(config: EngineConfig, model_dir: Path, unmapped: bool) -> CausalLM:
    converted = _converted(model_dir)
    choice = choose(config, model_dir)
    builder = _ReadyHook(config.moe, converted, unmapped)
    placement = _placement_rules(config.moe.placement, choice, converted)
    model = load_model(
        model_dir,
        device=config.device,
        dtype=config.dtype,
        placement=placement,
        experts_ready=builder,
        before_alloc=_memory_check(config, choice) if config.max_host_memory else None,
        int8_linears=True,  # _build_hybrid: apply_dense_backends
        expert_quantizer=None if config.moe.gpu_experts else _int8_on_arrival,
        linear_rounding=None if placement is None else _linear_rounding(),
    )
    model.placement_choice = choice
    log.info("%s", choice.line())
    trim_heap()  # the last layer's loaded copy: gone before the dense layouts are built
    if model.hybrid_plan is not None:
        _build_hybrid(model, config.moe, converted, builder.done)
    if config.moe.max_deferred_experts_per_token:
        model.set_expert_deferral(config.moe.max_deferred_experts_per_token)
    trim_heap()
    if config.moe.record_routing_stats:
        from hetserve.moe.routing_stats import RoutingStats

        model.attach_routing_stats(RoutingStats())
    return model


def _int8_on_arrival(plan: HybridPlan, name: str):
    """The loader's `expert_quantizer`: experts that only the native cpu-int8 backend serves (the
    all-int8 placement on a CPU: every phase on the host, no hot experts on a device) are rounded
    to its per-row int8 as each tensor is read, so a dense (fp32, bf16) checkpoint's layer never
    exists in full precision: the load's peak is the steady state plus one layer in int8, not in
    fp32 (1.7 B MoE, fp32 safetensors: ~800 MB less)."""
    from hetserve.moe.cpu_backends import _use_native
    from hetserve.moe.placement import PHASES
    from hetserve.quant.packed import Int8Rows

    chosen = {(a.device, a.backend) for a in (plan.placement.get(name, p) for p in PHASES)}
    experts = plan.units.get(name)
    if chosen != {("cpu", "cpu-int8")} or experts is None:
        return None
    if not _use_native("cpu-int8", "auto", experts.activation):
        return None  # the library kernel quantizes its own way
    return Int8Rows.per_row


def _linear_rounding():
    """The loader's `linear_rounding`: the per-row int8 an Int8Linear on the native kernel makes
    of a dense weight, so a dense checkpoint's linears bound for it are rounded as they are read
    (never all held in fp32 until the dense backends are built); None where the library kernel
    would serve them (it rounds its own way)."""
    from hetserve.layers.int8_linear import _native_ok
    from hetserve.quant.packed import Int8Rows

    return Int8Rows.per_row if _native_ok() else None


def kv_dtype(config: EngineConfig, model: CausalLM, choice: PlacementChoice | None = None):
    """The KV cache's dtype for `model` as `config` asks (kv/paged.py's resolve_kv_dtype):
    "auto" is fp16 on the CPU under the all-int8 preset (approximate already; what `--placement
    auto` picks there), the model's dtype elsewhere: `device` is exact, and a rules file says
    itself what it approximates."""
    from hetserve.kv.paged import resolve_kv_dtype
    from hetserve.model.loader import resolve_device

    choice = choice or getattr(model, "placement_choice", None)
    cpu = resolve_device(config.device).type == "cpu"
    half = cpu and choice is not None and choice.preset == "all-int8"
    return resolve_kv_dtype(config.cache.kv_cache_dtype, next(model.parameters()).dtype, half)


def prefill_bf16(config: EngineConfig, model: CausalLM, kv: torch.dtype) -> bool:
    """Whether the CPU prefill-attention kernel multiplies in bf16 (`--prefill-attention-dtype`):
    "auto" says yes where the KV cache is 16-bit and the dense linears run on the int8 kernels
    (all-int8, or a rules file that does the same: approximate already; bf16 products moved the
    tiny models' mean logprob error by at most 4%, tests/layers/test_native_prefill.py) and
    this build has vdpbf16ps (the kernel then runs ~1.75x the fp32 rate at 2k tokens); never on
    other devices."""
    from hetserve.layers.int8_linear import Int8Linear
    from hetserve.layers.native_prefill import bf16_products_ok
    from hetserve.model.loader import resolve_device

    asked = config.cache.prefill_attention_dtype
    if asked == "float32" or resolve_device(config.device).type != "cpu":
        return False
    if asked == "auto":
        int8 = any(isinstance(m, Int8Linear) for m in model.modules())
        if not int8 or kv.itemsize != 2:
            return False
    return bf16_products_ok(128, 128)


def _memory_check(config: EngineConfig, choice: PlacementChoice):
    """The loader's `before_alloc`: refuses (InvalidInputError, one line) a placed model whose
    estimated host memory exceeds --max-host-memory, before any weight is read."""
    from hetserve.core.memory import refusal
    from hetserve.model.memory_facts import estimate, rss_bytes

    baseline = rss_bytes()

    def check(model: CausalLM) -> None:
        use = estimate(model, _kv_estimate(config, model, choice), baseline)
        reason = refusal(use, config.max_host_memory)
        if reason is not None:
            raise InvalidInputError(reason)
        log.info("estimated %s", use.line())

    return check


def _kv_estimate(config: EngineConfig, model: CausalLM, choice: PlacementChoice) -> int:
    """The KV cache's bytes as EngineCore will size it (kv/sizing.py's num_kv_blocks)."""
    from hetserve.kv.cache_spec import paged_layout
    from hetserve.kv.paged import PagedKVCache
    from hetserve.kv.sizing import num_kv_blocks

    mcfg = model.config
    max_len = min(config.max_model_len or mcfg.max_position_embeddings,
                  mcfg.max_position_embeddings)  # fmt: skip
    dtype = kv_dtype(config, model, choice)
    spec = paged_layout(model.cache_specs())
    n = num_kv_blocks(config, max_len, spec, dtype)
    return n * PagedKVCache.bytes_per_block(spec, config.cache.block_size, dtype)


def _converted(model_dir: Path) -> dict | None:
    """The `hetserve_experts` entry of a checkpoint made by `hetserve convert`, if any."""
    path = model_dir / "config.json"
    return read_config_json(path).get("hetserve_experts") if path.is_file() else None


def choose(config: EngineConfig, model_dir: Path) -> PlacementChoice:
    """What `--placement` means here: a preset, `auto` resolved from this machine and model,
    or a rules file. Raises InvalidInputError for a preset that cannot run on this device."""
    from hetserve.model.loader import resolve_device
    from hetserve.moe.presets import PlacementFacts, choose_placement, preset_name

    requested = config.moe.placement
    dev = resolve_device(config.device)
    accelerator = str(dev) if dev.type != "cpu" else None
    if preset_name(requested) == "auto":
        facts = PlacementFacts(
            accelerator=accelerator,
            accelerator_bytes=_device_bytes(dev),
            weight_bytes=_checkpoint_bytes(model_dir),
            kv_bytes=config.cache.kv_cache_bytes or _default_kv_bytes(),
            dtype=config.dtype,
            native_unavailable=_native_unavailable() if accelerator is None else None,
        )
    else:
        facts = PlacementFacts(accelerator=accelerator, dtype=config.dtype)
    choice = choose_placement(requested, facts)
    if choice.preset == "all-int8" and accelerator is not None:
        raise InvalidInputError(
            f"placement all-int8 runs every weight on the CPU, but the engine device is "
            f"{accelerator}; add --device cpu, or use --placement hybrid"
        )
    return choice


def _native_unavailable() -> str | None:
    from hetserve import envs
    from hetserve.native import native_unavailable_reason

    return native_unavailable_reason() if envs.native_kernels() else "HETSERVE_NATIVE_KERNELS=0"


def _device_bytes(dev) -> int:
    import torch

    return torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else 0


def _checkpoint_bytes(model_dir: Path) -> int:
    """The weights' bytes as stored (a GGUF file, or the directory's weight files)."""
    if model_dir.is_file():
        return model_dir.stat().st_size
    files = [*model_dir.glob("*.safetensors"), *model_dir.glob("*.gguf"), *model_dir.glob("*.hsk")]
    return sum(f.stat().st_size for f in files)


def _default_kv_bytes() -> int:
    from hetserve.config_sections import CPU_KV_CAP_BYTES  # the engine's budget when none is given

    return CPU_KV_CAP_BYTES


def _placement_rules(requested: str, choice: PlacementChoice, converted: dict | None):
    """What the loader takes: None (everything on the engine device), a preset name, or rules."""
    from hetserve.moe.placement import default_rules, load_rules
    from hetserve.moe.presets import preset_rules

    if choice.preset is None:
        if not Path(requested).exists():  # neither a preset nor a rules file
            from hetserve.moe.placement import PlacementError
            from hetserve.moe.presets import PRESETS

            raise PlacementError(
                f"--placement {requested!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                "rules file"
            )
        return load_rules(requested)
    if converted is not None:
        # A converted model has its experts only in the CPU format it was converted to.
        backend = f"cpu-{converted['format']}"
        if choice.preset == "device":
            return default_rules(backend)
        return preset_rules(choice.preset, backend)
    return None if choice.preset == "device" else choice.preset


class _ReadyHook:
    """The loader's `experts_ready`: builds each routed-experts module's backends as soon as
    its weights are in (model/hybrid_plan.py's ExpertsBuilder, made at the first call, when
    the plan exists), so the loaded copy goes before the next layer is read."""

    def __init__(self, moe: MoEConfig, converted: dict | None, unmapped: bool = False) -> None:
        self.moe, self.converted, self.unmapped = moe, converted, unmapped
        self.builder = None
        self.done: set[str] = set()

    def __call__(self, plan: HybridPlan, name: str, experts) -> None:
        if self.builder is None:
            self.builder = _experts_builder(plan, self.moe, self.converted)
        fragmenting = _rounded_as_read(experts)
        with heap_reused() if self.unmapped else contextlib.nullcontext():
            self.builder(name, experts)
        self.done.add(name)
        if fragmenting:  # see load_heap.trim_heap
            trim_heap()


def _rounded_as_read(experts) -> bool:
    """Whether `experts` were rounded to per-row int8 as their dense tensors were read."""
    from hetserve.quant.packed import Int8PerRow

    return experts.packed is not None and isinstance(experts.packed.w2[0], Int8PerRow)


def _build_hybrid(
    model: CausalLM, moe: MoEConfig, converted: dict | None, done: set[str] = frozenset()
) -> None:
    build = _experts_builder(model.hybrid_plan, moe, converted)
    for name, experts in model.routed_experts():
        if name not in done:  # built while loading
            build(name, experts)
    apply_dense_backends(model, model.hybrid_plan, moe.activation_bits)
    log.info("placement:\n%s", model.hybrid_plan.table())


def _experts_builder(plan: HybridPlan, moe: MoEConfig, converted: dict | None):
    from hetserve.model.hybrid_plan import ExpertsBuilder
    from hetserve.moe.routing_stats import RoutingStats

    stats = RoutingStats.load(moe.routing_stats) if moe.routing_stats else None
    options = {}
    if converted is not None and converted.get("group_size"):
        options["cpu-int4"] = {"group_size": converted["group_size"]}
    if moe.activation_bits != 16:
        options["cpu-int8"] = {"activation_bits": moe.activation_bits}
    return ExpertsBuilder(
        plan, moe.gpu_experts, stats, moe.cpu_threads, backend_options=options, numa=moe.numa
    )


def _int8_embedding(model: CausalLM, name: str, unit) -> None:
    """The token embeddings from the checkpoint's quantized rows where the loader kept them (a
    GGUF file's q8_0 / q4_K under all-int8, model/loader.py); a tied lm_head reads the same
    matrix on the int8 kernels."""
    from hetserve.layers.quant_embedding import QuantEmbedding

    packed = getattr(unit, "packed_weight", None)
    if packed is None:
        return  # safetensors: the embeddings stay as loaded
    if model.config.tie_word_embeddings and not hasattr(model.lm_head, "packed_weight"):
        model.lm_head.packed_weight = packed
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attr, QuantEmbedding(packed))


def apply_dense_backends(model: CausalLM, plan: HybridPlan, activation_bits: int = 16) -> int:
    """Swap the linears of non-expert units placed with `cpu-int8` for Int8Linear (which keeps
    a linear's checkpoint numbers where the loader kept them: GGUF q8_0 / q4_K), rounding
    activations to `activation_bits` (MoEConfig's)."""
    from torch import nn

    from hetserve.layers.int8_linear import int8_linear, quantize_linears
    from hetserve.layers.moe import FusedExperts

    count = 0
    for name, unit in plan.units.items():
        if isinstance(unit, FusedExperts) or plan.placement.get(name).backend is None:
            continue
        if isinstance(unit, nn.Embedding):
            _int8_embedding(model, name, unit)
            continue
        if isinstance(unit, nn.Linear):  # lm_head itself
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, int8_linear(unit, activation_bits))
            count += 1
        else:
            count += quantize_linears(unit, activation_bits)
    for module in model.modules():  # checkpoint matrices no int8 linear took (model/filler.py)
        for attr in ("packed_weight", "mapped_layout"):
            if isinstance(module, nn.Linear) and hasattr(module, attr):
                delattr(module, attr)
    return count
