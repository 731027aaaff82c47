"""Maps checkpoint weights onto a model's parameters and tracks what has been filled.

Routed experts are accepted one tensor per expert (what checkpoints on disk hold:
`experts.{e}.gate_proj|up_proj|down_proj.weight`, Mixtral `experts.{e}.w1|w3|w2.weight`) and as
fused tensors (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]). Experts that
the checkpoint stores quantized stay in that format (`PackedExperts`, assembled here); any
other quantized weight is dequantized into its parameter. A linear's weight in a format the
quantized dense kernels read (GGUF q8_0 / q2_K-q6_K / IQ4) is also kept beside it, as the
linear's `packed_weight`, when a placement could give that linear such a kernel (int8_linear.py
serves those numbers exactly; model/hybrid_plan.py drops what it does not use). A linear
weight the loader left unallocated (meta: a GGUF load's int8 linears, model/loader.py) gets
only that: the checkpoint's QMatrix, or a dense tensor rounded to int8 (`linear_rounding`:
a dense checkpoint's as its Int8Linear would, per row; else in groups of 32,
`Int8Rows.linear_groups`), so no fp32 copy of those linears is ever filled. Experts given a
`quantizer` (dense checkpoints whose experts a CPU int8 backend alone serves: model/loader.py)
are quantized as each tensor arrives and assembled packed, so no full-precision copy of their
layer exists either.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import torch
from torch import nn

from hetserve.errors import MissingTensorError, ModelLoadError, TensorShapeError
from hetserve.layers.moe import FusedExperts
from hetserve.model.base import CausalLM
from hetserve.quant.packed import BlockRows, Int8Rows, PackedExperts, QMatrix

# The checkpoint matrices the dense kernels read as they are (layers/int8_linear.py).
LINEAR_KINDS = (Int8Rows, BlockRows)  # q8_0 and every GGUF block type

PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Which half of w13 (0 = gate, 1 = up) or w2 a per-expert tensor fills.
_PART = {
    "gate_proj": ("w13", 0),
    "w1": ("w13", 0),
    "up_proj": ("w13", 1),
    "w3": ("w13", 1),
    "down_proj": ("w2", None),
    "w2": ("w2", None),
}
_HALF_NAMES = {0: "gate_proj", 1: "up_proj", None: "down_proj"}


def expert_prefix(name: str) -> str | None:
    """The experts module a (model-space) expert weight name belongs to, else None."""
    m = PER_EXPERT.match(name) or FUSED.match(name)
    return m.group(1) if m else None


class PackedExpertsBuilder:
    """Collects one experts module's quantized matrices (per expert or fused) as they arrive."""

    def __init__(self, prefix: str, experts: FusedExperts) -> None:
        self.prefix, self.experts = prefix, experts
        self.parts: dict[tuple[str, int, int | None], QMatrix] = {}
        self.fused: dict[str, QMatrix] = {}

    def _shape(self, pname: str, half: int | None) -> tuple[int, int]:
        i, h = self.experts.intermediate_size, self.experts.hidden_size
        if pname == "w2":
            return (h, i)
        return (i, h) if half is not None else (2 * i, h)

    def check_shape(
        self, pname: str, e: int | None, half: int | None, shape: tuple, ckpt: str
    ) -> None:
        want = self._shape(pname, half)
        if e is None:
            want = (self.experts.num_experts, *want)
        if tuple(shape) != want:
            raise TensorShapeError(
                f"tensor {ckpt!r} has shape {tuple(shape)}, expected {want}; the "
                "checkpoint does not match config.json"
            )

    def add(self, pname: str, e: int | None, half: int | None, value, ckpt: str) -> None:
        if not isinstance(value, QMatrix):
            raise ModelLoadError(
                f"tensor {ckpt!r} is not quantized while other routed experts of "
                f"{self.prefix!r} are; mixing quantized and unquantized experts is not supported"
            )
        self.check_shape(pname, e, half, tuple(value.shape), ckpt)
        if e is None:
            self.fused[pname] = value
        elif e >= self.experts.num_experts:
            raise TensorShapeError(
                f"tensor {ckpt!r} names expert {e}, but the config has {self.experts.num_experts}"
            )
        else:
            self.parts[(pname, e, half)] = value

    def _get(self, pname: str, e: int, half: int | None) -> QMatrix:
        if pname in self.fused:
            m = self.fused[pname].select(e)
            if half is None:
                return m
            i = self.experts.intermediate_size
            return m.rows(slice(half * i, (half + 1) * i))
        got = self.parts.pop((pname, e, half), None)  # laid out once: the builder lets it go
        if got is None:
            raise MissingTensorError(
                f"checkpoint lacks tensor '{self.prefix}.{e}.{_HALF_NAMES[half]}.weight' "
                "(or the fused experts tensor); the checkpoint is incomplete"
            )
        return got

    def build(self) -> PackedExperts:
        """The layer's PackedExperts; per-expert parts are let go as they are taken, so gate and
        up exist beside their concatenation one expert at a time."""
        w13, w2 = [], []
        for e in range(self.experts.num_experts):
            if "w13" in self.fused:
                w13.append(self.fused["w13"].select(e))
            else:
                w13.append(type(g := self._get("w13", e, 0)).cat_rows([g, self._get("w13", e, 1)]))
            w2.append(self._get("w2", e, None))
        return PackedExperts(tuple(w13), tuple(w2))


def _quantized(
    quantize: Callable[[torch.Tensor], QMatrix], w: torch.Tensor, fused: bool
) -> QMatrix:
    """One expert's matrix quantized (a fused tensor's: each expert's, stacked; each expert
    converted to the model's dtype on its own, never the whole layer)."""
    if not fused:
        return quantize(w)
    mats = [quantize(w[e]) for e in range(w.shape[0])]
    fields = {f: torch.stack([getattr(m, f) for m in mats]) for f in mats[0].row_dims}
    return dataclasses.replace(mats[0], **fields)


def _dense(value, ckpt: str) -> torch.Tensor:
    if isinstance(value, QMatrix):
        return value.dequantize()
    if not value.is_floating_point() or value.element_size() < 2:
        raise ModelLoadError(f"tensor {ckpt!r} has dtype {value.dtype}; expected a float weight")
    return value


ExpertsReady = Callable[[str, FusedExperts], None]


class WeightFiller:
    """`experts_ready(name, module)`, when given, is called as soon as an experts module has
    all its tensors (dense or packed), so its backend is built and its loaded copy dropped
    before the next layer is read (the streaming load: peak = steady state + one layer)."""

    def __init__(
        self,
        model: CausalLM,
        packed: set[str],
        experts_ready: ExpertsReady | None = None,
        quantizers: dict[str, Callable[[torch.Tensor], QMatrix]] | None = None,
        linear_rounding: Callable[[torch.Tensor], QMatrix] | None = None,
        elsewhere: set[str] = frozenset(),
    ) -> None:
        self.model = model
        # parameters whose numbers come from elsewhere (a converted file's mapped linears):
        # their checkpoint tensors are not read
        self.elsewhere = elsewhere
        self.quantizers = quantizers or {}  # experts prefix -> quantizer (also in `packed`)
        # how an unallocated linear's dense weight is rounded
        self.linear_rounding = linear_rounding or Int8Rows.linear_groups
        self.params = dict(model.named_parameters())
        self.filled: set[str] = set()  # plain params, and "w13:e:half" / "w2:e" expert parts
        self.num_layers = model.config.num_layers
        self.modules = dict(model.named_modules())
        self.packed = {p: PackedExpertsBuilder(p, self.modules[p]) for p in packed}
        self.experts_ready = experts_ready
        self._parts: dict[str, int] = {}  # experts prefix -> expert matrices (thirds) filled
        self.ready: set[str] = set()

    def _count(self, prefix: str, e: int | None, pname: str) -> None:
        """One expert's gate, up or down (or a fused tensor: all experts' share) arrived."""
        module = self.modules[prefix]
        n = module.num_experts
        add = 1 if e is not None else (2 * n if pname == "w13" else n)
        self._parts[prefix] = self._parts.get(prefix, 0) + add
        self._maybe_ready(prefix)

    def _maybe_ready(self, prefix: str) -> None:
        module = self.modules[prefix]
        biases = [b for b in ("b13", "b2") if getattr(module, b) is not None]
        if (
            self.experts_ready is None
            or prefix in self.ready
            or self._parts.get(prefix, 0) < 3 * module.num_experts
            or any(f"{prefix}.{b}" not in self.filled for b in biases)
        ):
            return
        builder = self.packed.get(prefix)
        if builder is not None:
            module.packed = builder.build()
            builder.parts.clear()
            builder.fused.clear()
        self.ready.add(prefix)
        self.experts_ready(prefix, module)

    def target(self, name: str) -> str | None:
        """Parameter-space name for a checkpoint name (after aliases), None to skip it."""
        m = _LAYER.match(name)
        if (m and int(m.group(1)) >= self.num_layers) or name.endswith("rotary_emb.inv_freq"):
            return None  # extra layers (DeepSeek's MTP module) and derived buffers
        candidates = [name] + [re.sub(p, r, name) for p, r in self.model.checkpoint_aliases]
        for cand in candidates:
            if cand in self.params:
                return None if cand in self.elsewhere else cand
            prefix = expert_prefix(cand)
            if prefix is not None and f"{prefix}.w13" in self.params:
                return cand
        return None

    def fill(self, name: str, value, ckpt_name: str) -> None:
        em = PER_EXPERT.match(name)
        fm = FUSED.match(name)
        if em:
            prefix, e, (pname, half) = em.group(1), int(em.group(2)), _PART[em.group(3)]
        elif fm:
            prefix, e, half = fm.group(1), None, None
            pname = "w13" if fm.group(2) == "gate_up_proj" else "w2"
        if (em or fm) and prefix in self.quantizers:
            self.packed[prefix].check_shape(pname, e, half, tuple(value.shape), ckpt_name)
            dtype = self.modules[prefix].w13.dtype  # the numbers the model would have held
            quantize = self.quantizers[prefix]
            fused = fm is not None
            value = _quantized(lambda w: quantize(w.to(dtype)), _dense(value, ckpt_name), fused)
        if (em or fm) and prefix in self.packed:
            self.packed[prefix].add(pname, e, half, value, ckpt_name)
            self._count(prefix, e, pname)
            return
        if not (em or fm) and name in self.params and self.params[name].is_meta:
            self._fill_int8_linear(name, value, ckpt_name)
            return
        if isinstance(value, LINEAR_KINDS) and not (em or fm):
            self._keep_packed(name, value)
        value = _dense(value, ckpt_name)
        if em or fm:
            self.modules[prefix].materialize(torch.device("cpu"))
        if em:
            param = getattr(self.modules[prefix], pname)
            if e >= param.shape[0]:
                raise TensorShapeError(
                    f"tensor {ckpt_name!r} names expert {e}, but the config has {param.shape[0]}"
                )
            dst = param.data[e]
            if half is not None:
                inter = param.shape[1] // 2
                dst = dst[half * inter : (half + 1) * inter]
            self._copy(dst, value, ckpt_name)
            key = f"{prefix}.{pname}:{e}:{half}"
            if key not in self.filled:
                self.filled.add(key)
                self._count(prefix, e, pname)
            return
        if fm:
            self._copy(getattr(self.modules[prefix], pname).data, value, ckpt_name)
            if f"{prefix}.{pname}" not in self.filled:
                self.filled.add(f"{prefix}.{pname}")
                self._count(prefix, None, pname)
            return
        self._copy(self.params[name].data, value, ckpt_name)
        self.filled.add(name)
        owner, _, leaf = name.rpartition(".")
        if leaf in ("b13", "b2") and isinstance(self.modules.get(owner), FusedExperts):
            self._maybe_ready(owner)  # biases may come after the matrices

    def _keep_packed(self, name: str, value: QMatrix) -> None:
        owner_name, _, leaf = name.rpartition(".")
        owner = self.modules.get(owner_name)
        placed = getattr(self.model, "hybrid_plan", None) is not None
        if leaf == "weight" and type(owner) is nn.Linear and placed:
            owner.packed_weight = value

    def _fill_int8_linear(self, name: str, value, ckpt_name: str) -> None:
        owner_name, _, leaf = name.rpartition(".")
        owner = self.modules.get(owner_name)
        if leaf != "weight" or not isinstance(owner, (nn.Linear, nn.Embedding)):
            raise ModelLoadError(f"parameter {name!r} was left unallocated but is no int8 linear")
        want = tuple(self.params[name].shape)
        if name == "lm_head.weight" and self.model.config.tie_word_embeddings:
            self.filled.add(name)  # the embeddings' matrix serves it (tie_weights), as before
            return
        if tuple(value.shape) != want:  # before rounding: a wrong rank is this error too
            raise TensorShapeError(
                f"tensor {ckpt_name!r} has shape {tuple(value.shape)}, expected {want}; the "
                "checkpoint does not match config.json"
            )
        if not isinstance(value, LINEAR_KINDS):  # one tensor, rounded, dropped
            w = _dense(value, ckpt_name).to(self.params[name].dtype)  # what the model held
            value = self.linear_rounding(w)
        owner.packed_weight = value
        self.filled.add(name)

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor, ckpt_name: str) -> None:
        if tuple(dst.shape) != tuple(src.shape):
            raise TensorShapeError(
                f"tensor {ckpt_name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}; "
                "the checkpoint does not match config.json"
            )
        dst.copy_(src)

    def finish_packed(self) -> None:
        """Hands every packed experts module its assembled matrices."""
        for prefix, builder in self.packed.items():
            if prefix not in self.ready:
                builder.experts.packed = builder.build()

    def check_complete(self, experts_elsewhere: bool = False) -> None:
        tied = self.model.config.tie_word_embeddings
        for name, param in self.params.items():
            if name in self.filled or name in self.elsewhere or (tied and name == "lm_head.weight"):
                continue
            prefix, _, pname = name.rpartition(".")
            if pname in ("w13", "w2") and (experts_elsewhere or prefix in self.packed):
                continue  # filled from the converted experts file, or packed
            if pname in ("w13", "w2") and prefix.endswith(".experts"):
                self._check_experts(name, param, prefix, pname)
                continue
            raise MissingTensorError(
                f"checkpoint lacks tensor {name!r}; the checkpoint is incomplete or for "
                "another architecture"
            )

    def _check_experts(self, name: str, param: nn.Parameter, prefix: str, pname: str) -> None:
        for e in range(param.shape[0]):
            for half in (0, 1) if pname == "w13" else (None,):
                if f"{name}:{e}:{half}" not in self.filled:
                    raise MissingTensorError(
                        f"checkpoint lacks tensor '{prefix}.{e}.{_HALF_NAMES[half]}.weight' "
                        "(or the fused experts tensor); the checkpoint is incomplete"
                    )
