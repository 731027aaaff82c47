"""`hetserve finetune CONFIG.yaml`'s configuration: LLaMA-Factory's SFT keys, validated once.

Pure policy: a mapping in, a frozen `FinetuneConfig` plus the notes to print out; no I/O besides
`load_config` reading the YAML file. A key we do not know is a `ConfigError` naming it and the
closest known key; keys of LLaMA-Factory that do not apply here come back as notes (one line
each) and are ignored. Values keep LLaMA-Factory's meaning (and HF Trainer's defaults).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields
from pathlib import Path

from hetserve.errors import InvalidInputError


class ConfigError(InvalidInputError):
    """A fine-tuning config is invalid; the message names the key and the fix."""


# LLaMA-Factory keys accepted and ignored, with why (printed once each).
IGNORED = {
    "report_to": "no experiment trackers here; see trainer_log.jsonl",
    "ddp_timeout": "single process",
    "dataloader_num_workers": "data is tokenized up front",
    "preprocessing_num_workers": "data is tokenized up front",
    "dataloader_pin_memory": "data is tokenized up front",
    "overwrite_cache": "nothing is cached between runs",
    "trust_remote_code": "hetserve runs its own model classes",
    "flash_attn": "attention runs through torch SDPA",
    "deepspeed": "single process",
    "ddp_find_unused_parameters": "single process",
    "run_name": "no experiment trackers here",
    "logging_dir": "logs go to output_dir",
    "save_only_model": "checkpoints always keep optimizer and RNG state",
    "include_num_input_tokens_seen": "tokens/s is always reported",
    "packing": "sequences are always concatenated without padding",
    "neat_packing": "sequences never attend across each other",
    "enable_liger_kernel": "hetserve has its own kernels",
    "use_unsloth": "hetserve has its own kernels",
    "upcast_layernorm": "norms compute in fp32 already",
    "low_cpu_mem_usage": "weights are memory-mapped",
    "pure_bf16": "use bf16",
    "fp16": "CUDA uses bf16, the CPU fp32",
    "do_sample": "predictions are greedy",
    "temperature": "predictions are greedy",
    "top_p": "predictions are greedy",
    "top_k": "predictions are greedy",
    "kt_use_cuda_graph": "no CUDA graphs in training",
    "save_total_limit": "every checkpoint is kept",
    "tokenized_path": "data is tokenized on each run",
}

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")


@dataclass(frozen=True)
class FinetuneConfig:
    model_name_or_path: str
    output_dir: str
    stage: str = "sft"
    do_train: bool = True
    finetuning_type: str = "lora"
    lora_rank: int = 8
    lora_alpha: float | None = None  # None: 2 * lora_rank, as LLaMA-Factory
    lora_dropout: float = 0.0
    lora_target: str | list = "all"
    use_dora: bool = False
    adapter_name_or_path: str | None = None  # start from (or predict with) a saved adapter
    dataset: str | None = None
    eval_dataset: str | None = None
    dataset_dir: str = "data"
    template: str | None = None  # None: the model's own chat template
    cutoff_len: int = 2048
    max_samples: int | None = None
    val_size: float = 0.0
    per_device_train_batch_size: int = 1
    per_device_eval_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    num_train_epochs: float = 3.0
    max_steps: int = -1
    lr_scheduler_type: str = "linear"
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    bf16: bool = False
    seed: int = 42
    overwrite_output_dir: bool = False
    logging_steps: int = 10
    save_steps: int = 500
    eval_steps: int | None = None
    eval_strategy: str = "no"
    do_eval: bool = False
    do_predict: bool = False
    predict_with_generate: bool = False
    max_new_tokens: int = 512
    plot_loss: bool = False
    resume_from_checkpoint: str | None = None
    gradient_checkpointing: bool = False
    # KTransformers' integration keys, mapped onto hetserve's placement.
    use_kt: bool = False
    kt_optimize_rule: str | None = None  # a hetserve placement YAML
    cpu_infer: int | None = None  # threads of the CPU experts
    chunk_size: int | None = None  # most tokens per CPU experts call
    quantization_bit: int | None = None  # 8 | 4: routed experts int8/int4 on the CPU

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        need(self.stage == "sft", f"stage {self.stage!r}: only 'sft' is supported")
        need(self.finetuning_type == "lora", "finetuning_type: only 'lora' is supported")
        need(self.lora_rank >= 1, "lora_rank must be >= 1")
        need(0.0 <= self.lora_dropout < 1.0, "lora_dropout must be in [0, 1)")
        need(not self.do_train or bool(self.dataset), "do_train needs 'dataset'")
        need(self.cutoff_len >= 2, "cutoff_len must be >= 2")
        need(self.per_device_train_batch_size >= 1, "per_device_train_batch_size must be >= 1")
        need(self.per_device_eval_batch_size >= 1, "per_device_eval_batch_size must be >= 1")
        need(self.lora_alpha is None or self.lora_alpha > 0, "lora_alpha must be > 0")
        need(
            self.eval_strategy in ("no", "steps"),
            f"eval_strategy {self.eval_strategy!r}: use 'no' or 'steps' (with eval_steps)",
        )
        need(self.eval_steps is None or self.eval_steps >= 1, "eval_steps must be >= 1")
        need(0.0 <= self.adam_beta1 < 1.0 and 0.0 <= self.adam_beta2 < 1.0,
             "adam_beta1 and adam_beta2 must be in [0, 1)")  # fmt: skip
        need(self.adam_epsilon >= 0 and self.weight_decay >= 0,
             "adam_epsilon and weight_decay must be >= 0")  # fmt: skip
        need(self.warmup_steps >= 0, "warmup_steps must be >= 0")
        need(self.max_new_tokens >= 1, "max_new_tokens must be >= 1")
        need(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be >= 1")
        need(self.learning_rate > 0, "learning_rate must be > 0")
        need(
            self.lr_scheduler_type in SCHEDULERS,
            f"lr_scheduler_type {self.lr_scheduler_type!r}: use one of {', '.join(SCHEDULERS)}",
        )
        need(0.0 <= self.warmup_ratio < 1.0, "warmup_ratio must be in [0, 1)")
        need(self.val_size >= 0, "val_size must be >= 0 (a fraction < 1, or a row count)")
        need(self.save_steps >= 1 and self.logging_steps >= 1, "save/logging_steps must be >= 1")
        need(
            self.quantization_bit in (None, 8, 4),
            f"quantization_bit {self.quantization_bit}: use 8 or 4 (routed experts on the CPU)",
        )
        need(self.chunk_size is None or self.chunk_size >= 1, "chunk_size must be >= 1")
        need(
            self.kt_optimize_rule is None or self.use_kt,
            "kt_optimize_rule places the experts on the CPU backends: set use_kt: true as well",
        )
        need(self.cpu_infer is None or self.cpu_infer >= 1, "cpu_infer must be >= 1")
        need(
            self.max_steps > 0 or self.num_train_epochs > 0,
            "set max_steps or num_train_epochs",
        )

    @property
    def alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank

    @property
    def targets(self) -> str | list[str]:
        t = self.lora_target
        if isinstance(t, str):
            t = [s.strip() for s in t.split(",") if s.strip()]
        return "all" if t == ["all"] else list(t)

    def datasets(self, which: str = "dataset") -> list[str]:
        value = getattr(self, which) or ""
        return [s.strip() for s in value.split(",") if s.strip()]

    @property
    def evaluates(self) -> bool:
        return self.do_eval or self.eval_strategy == "steps"


FIELDS = {f.name: f for f in fields(FinetuneConfig)}


def parse_config(data: object, source: str = "<config>") -> tuple[FinetuneConfig, list[str]]:
    """A mapping of LLaMA-Factory keys -> (config, notes about ignored keys)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of keys to values")
    notes, values = [], {}
    for key, value in data.items():
        if key in IGNORED:
            notes.append(f"{source}: ignoring {key!r} ({IGNORED[key]})")
        elif key in FIELDS:
            values[key] = _coerce(key, value, source)
        else:
            close = difflib.get_close_matches(str(key), [*FIELDS, *IGNORED], n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{source}: unknown key {key!r}{hint}")
    for key in ("model_name_or_path", "output_dir"):
        if key not in values:
            raise ConfigError(f"{source}: {key!r} is required")
    return FinetuneConfig(**values), notes


def _coerce(key: str, value, source: str):
    """YAML gives 5e-5 as a string (YAML 1.1 floats need a dot): accept numbers as strings.
    A list of datasets is the comma-separated names LLaMA-Factory takes."""
    kind = FIELDS[key].type
    strings = isinstance(value, list) and all(isinstance(v, str) for v in value)
    try:
        if value is None:
            if "None" not in kind:  # `key:` with no value: only where None means a default
                raise ValueError
            return None
        if kind in ("str", "str | None"):
            if strings and key in ("dataset", "eval_dataset"):
                return ",".join(value)
            if not isinstance(value, str):
                raise ValueError
            return value
        if kind == "str | list" and not (isinstance(value, str) or strings):
            raise ValueError
        if "bool" in kind and "str" not in kind:
            if not isinstance(value, bool):
                raise ValueError
            return value
        if kind.startswith("int"):
            if isinstance(value, bool) or float(value) != int(float(value)):
                raise ValueError
            return int(float(value))
        if kind.startswith("float"):
            if not math.isfinite(float(value)):
                raise ValueError
            return float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
        raise ConfigError(f"{source}: {key}: {value!r} is not a valid {kind}") from None
    return value


def load_config(path: str | Path) -> tuple[FinetuneConfig, list[str]]:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        where = f" at line {line + 1}" if line is not None else ""
        raise ConfigError(f"{p}: not valid YAML{where}") from None
    return parse_config(data, str(p))
