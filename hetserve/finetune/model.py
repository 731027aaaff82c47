"""The training model: hetserve's inference classes under autograd, with PEFT's LoRA/DoRA layers.

Who calls it: the trainer (finetune/trainer.py), the evaluation and the tests. `load_for_training`
loads the model as inference does (same classes, same loader, placement rules for the routed
experts), freezes every base weight and makes the routed experts differentiable
(experts_grad.py). `add_lora` injects PEFT's layers by the HF module names our classes share, so
the adapter file is the one PEFT writes for the transformers model. Errors are one-line
`InvalidInputError`/`ModelLoadError`s raised before anything is trained.

The forward does not go through the engine: its runner works under inference mode on a paged
cache. `TrainKV` stands in for the cache instead: each layer's K/V (or MLA latent) of this
forward stay as autograd tensors, and every sequence attends causally over its own tokens with
the attention modules' own SDPA path. The native fast paths decline by themselves where a
gradient is needed (RMSNorm, rotary, the fused q/k norm + rotary + cache write, routing all
check `requires_grad`; decode attention never runs since no span is a decode); where they run
(inputs with no grad) their values equal the torch paths'.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from hetserve.errors import InvalidInputError
from hetserve.layers.attention import AttentionMetadata, ForwardContext, SeqSpan
from hetserve.model.base import CausalLM

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the base model's names


@dataclass(frozen=True)
class ExpertsPlacement:
    """Where the frozen routed experts live during training (KTransformers' keys mapped)."""

    on_cpu: bool = False  # use_kt: routed experts on the CPU backends
    rules_path: str | None = None  # kt_optimize_rule: a hetserve placement YAML
    bits: int = 32  # quantization_bit: 32 (fp32), 8 or 4
    cpu_threads: int | None = None  # cpu_infer
    chunk_size: int | None = None  # most tokens per CPU experts call
    group_size: int = 64  # int4 group


def _placement_rules(p: ExpertsPlacement):
    from hetserve.moe.placement import default_rules, load_rules

    if p.rules_path is not None:
        return load_rules(p.rules_path)
    backend = {32: "cpu-fp32", 8: "cpu-int8", 4: "cpu-int4"}[p.bits]
    return [replace(r, backend=backend) if r.backend else r for r in default_rules()]


def load_for_training(
    model_dir: str | Path, device: str = "auto", dtype: str = "auto", experts=ExpertsPlacement()
) -> CausalLM:
    """The model with frozen base weights and differentiable routed experts."""
    from hetserve.finetune.experts_grad import GradExperts, make_grad_weights
    from hetserve.model.hybrid_plan import ExpertsBuilder
    from hetserve.model.loader import load_model

    if experts.bits != 32 and not experts.on_cpu:
        raise InvalidInputError(
            "quantization_bit keeps the routed experts quantized on the CPU backends; "
            "set use_kt: true as well"
        )
    rules = _placement_rules(experts) if experts.on_cpu else None
    if experts.bits == 4:
        experts = replace(experts, group_size=_int4_group(model_dir, experts.group_size))
    model = load_model(model_dir, device=device, dtype=dtype, placement=rules)
    model.requires_grad_(False)
    builder = None
    if model.hybrid_plan is not None:
        options = {"cpu-int4": {"group_size": experts.group_size}}
        builder = ExpertsBuilder(
            model.hybrid_plan, cpu_threads=experts.cpu_threads, backend_options=options
        )
    # Layer by layer: its backends, then the backward's weights (a view of a backend's copy,
    # else made from the loaded ones, which go with the layer's last reference here).
    for name, fused in model.routed_experts():
        w13, w2 = fused.w13.data, fused.w2.data
        if builder is not None:
            builder(name, fused)
        placed = fused._phase_backends or {"prefill": fused._backend, "decode": fused._backend}
        on_host = w13.device.type == "cpu"
        bits = experts.bits if on_host else 32
        gw = _shared_grad_weights(bits, placed.values()) if on_host else None
        if gw is None:
            gw = make_grad_weights(w13, w2, bits, experts.group_size)
        del w13, w2
        # The placed backends (per phase), each given our backward.
        fused.set_phase_backends({
            k: GradExperts(b, gw, experts.chunk_size, experts.cpu_threads)
            for k, b in placed.items()
        })  # fmt: skip
    return model


def _shared_grad_weights(bits: int, backends) -> object | None:
    """The backward's weights as views of a forward backend's own copy, or None where no
    backend holds one it reads: fp32 experts from `NativeFp32Experts` (bf16 training on an
    accelerator too, whose bf16 weights the native backward does not read: it ran the
    per-expert torch reference instead), int8 from `NativeInt8Experts`' per-row quads (fmt 9).
    One copy of the experts instead of two, the same numbers (the backend's are the loaded
    weights widened, or rounded per row as `make_grad_weights` rounds them)."""
    from hetserve.finetune.experts_grad import GradWeights
    from hetserve.moe.cpu_native import NativeFp32Experts, NativeInt8Experts

    for b in backends:
        b = getattr(b, "inner", b)  # DeviceBridge: the host backend inside
        if bits == 32 and isinstance(b, NativeFp32Experts):
            shared = b.fp32_weights()
            if shared is not None:
                return GradWeights(32, *shared)
        if bits == 8 and isinstance(b, NativeInt8Experts):
            rows = b.int8_rows()
            if rows is not None:
                q13, s13, q2, s2 = rows
                return GradWeights(9, q13, q2, s13, None, s2)
    return None


def _int4_group(model_dir, preferred: int) -> int:
    """The int4 group size: `preferred` where it divides the hidden and expert sizes, else the
    largest of cpu-int4's sizes that does."""
    from hetserve.model.config import ModelConfig
    from hetserve.moe.cpu_backends import INT4_GROUP_SIZES

    cfg = ModelConfig.from_dir(model_dir)
    dims = (cfg.hidden_size, int(cfg.get("moe_intermediate_size", default=cfg.intermediate_size)))
    for g in (preferred, *sorted(INT4_GROUP_SIZES, reverse=True)):
        if all(d % g == 0 for d in dims):
            return g
    raise InvalidInputError(
        f"quantization_bit 4: no int4 group size in {INT4_GROUP_SIZES} divides the hidden and "
        f"expert sizes {dims}; use quantization_bit 8"
    )


class TrainKV:
    """Stands in for `PagedKVCache` in a training forward: `write` keeps this forward's rows of a
    layer as they are (autograd tensors), `gather` hands back a sequence's slice of them. Slots
    are row indices of the batch. `layers` holds per layer what a cache entry looks like (zero
    rows, the model's KV spec) but no storage: attention reads head sizes from it, and its
    non-float dtype makes the fused native cache write decline."""

    def __init__(self, spec: list[list[tuple[int, ...]]]) -> None:
        self.layers = [tuple(torch.empty(0, *s, dtype=torch.bool) for s in e) for e in spec]
        self.scales: list[list[torch.Tensor]] = [[] for _ in spec]  # never 8-bit: no scales
        self.quantized = False
        self.bf16_prefill = False  # as PagedKVCache's: a training forward keeps fp32 products
        self._rows: list[tuple[torch.Tensor, ...]] = [()] * len(spec)

    def write(self, layer: int, slots: torch.Tensor, *tensors: torch.Tensor) -> None:
        self._rows[layer] = tensors

    def gather(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, ...]:
        """The rows as written (the forward's own dtype: `dtype`, the paged cache's widening
        to the compute dtype, has nothing to widen here)."""
        start = int(slots[0])  # spans are contiguous row ranges (slots live on the CPU)
        return tuple(t.narrow(0, start, slots.shape[0]) for t in self._rows[layer])


def train_context(model: CausalLM, lengths: list[int], device: torch.device) -> ForwardContext:
    """Metadata for sequences of `lengths` concatenated in one forward, each attending causally
    to its own tokens only."""
    seqs, positions, start = [], [], 0
    for n in lengths:
        seqs.append(SeqSpan(start, n, n, torch.arange(start, start + n)))
        positions.append(torch.arange(n))
        start += n
    pos = torch.cat(positions).to(device)
    meta = AttentionMetadata(pos, torch.arange(start), seqs, None, model.sliding_window)
    return ForwardContext(meta, TrainKV(model.kv_cache_spec()))


def hidden_states(model: CausalLM, input_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Final hidden states [T, H] of concatenated sequences (under autograd if enabled)."""
    return model(input_ids, train_context(model, lengths, input_ids.device))


def peft_moe_names(model_type: str) -> set[str]:
    """Module names that PEFT, loading an adapter onto a transformers-5 model of this type,
    reads as the v4 per-expert projections and moves onto the fused routed experts (its
    `_MOE_TARGET_MODULE_MAPPING`): an adapter on the dense or shared MLPs under those names
    would not load as trained, so we do not target them for such models."""
    try:
        from peft.utils import transformers_weight_conversion as conv

        pattern = conv._MODEL_TO_CONVERSION_PATTERN.get(model_type)
        return set(conv._MOE_TARGET_MODULE_MAPPING.get(pattern, {}))
    except (ImportError, AttributeError):  # another PEFT: it has no such remapping to avoid
        return set()


def linear_module_names(model: CausalLM) -> list[str]:
    """LLaMA-Factory's `lora_target: all`: the leaf names of every linear but the LM head (and
    but the names PEFT would move onto the routed experts, `peft_moe_names`)."""
    skip = peft_moe_names(model.config.model_type)
    names = {
        name.rpartition(".")[2]
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name != "lm_head"
    }
    return sorted(names - skip)


def add_lora(model: CausalLM, targets: list[str] | str, rank: int, alpha: float,
             dropout: float, use_dora: bool, base_model: str = "") -> None:  # fmt: skip
    """Inject PEFT's LoRA (or DoRA) layers into the named modules; only they train."""
    peft = require("peft")

    known = linear_module_names(model)
    wanted = known if targets == "all" else list(targets)
    moe_names = peft_moe_names(model.config.model_type)
    for t in wanted:
        if t in moe_names:
            raise InvalidInputError(
                f"lora_target {t!r}: PEFT reads that name as the routed experts of a "
                f"{model.config.model_type} model, so the adapter would not load as trained; "
                "target the attention projections (or use lora_target: all)"
            )
        if t not in known:
            raise InvalidInputError(
                f"lora_target {t!r} names no linear module of this model; "
                f"choose from: all, {', '.join(known)} (routed experts cannot take LoRA here)"
            )
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=wanted,
        use_dora=use_dora, task_type="CAUSAL_LM", base_model_name_or_path=base_model,
    )  # fmt: skip
    with _plain_config(model):
        peft.inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)


def require(module: str):
    """An optional dependency of fine-tuning, or a one-line error naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise InvalidInputError(
            f"fine-tuning needs {module!r}: pip install 'hetserve[finetune]'"
        ) from None


@contextlib.contextmanager
def _plain_config(model: CausalLM):
    """PEFT reads `model.config` as a dict (or `to_dict()`/dataclass); ours is a dataclass
    holding a mappingproxy, which `dataclasses.asdict` cannot copy: show PEFT a dict of the
    keys it reads while it works."""
    cfg = model.config
    model.config = {"tie_word_embeddings": cfg.tie_word_embeddings, "model_type": None}
    try:
        yield
    finally:
        model.config = cfg


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def adapter_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the names PeftModel saves for the HF model."""
    import peft

    with _plain_config(model):
        state = peft.get_peft_model_state_dict(model)
    return {PEFT_PREFIX + k: v.detach().cpu().contiguous() for k, v in state.items()}


def save_adapter(model: CausalLM, out_dir: str | Path) -> None:
    """adapter_config.json + adapter_model.safetensors, as `PeftModel.save_pretrained`."""
    from hetserve.model.st_file import save_safetensors

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(adapter_state_dict(model), out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    model.peft_config["default"].save_pretrained(str(out))  # PEFT writes adapter_config.json


def load_adapter_weights(model: CausalLM, adapter_dir: str | Path) -> None:
    """Load a saved adapter's tensors into a model that `add_lora` prepared (resume)."""
    import peft
    from safetensors.torch import load_file

    state = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    state = {k.removeprefix(PEFT_PREFIX): v for k, v in state.items()}
    result = peft.set_peft_model_state_dict(model, state)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing:
        raise InvalidInputError(f"adapter in {adapter_dir} lacks {missing[0]!r}")
