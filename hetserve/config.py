"""Engine configuration: EngineConfig (its sections' dataclasses live in config_sections.py and
are importable from here too), and the one table of engine options that every entry point reads.

`ENGINE_OPTIONS` declares each option once: its keyword (for `LLM(...)` and the argparse
dest), its flag, its help, and the config field it sets. `add_engine_args` turns the table into
flags (serve, generate, chat, calibrate and the benchmarks all call it), `EngineConfig.from_args`
builds the config from parsed flags and `EngineConfig.from_options` from keyword arguments. A
bad value is a ValueError naming the option (the CLI prints it as one line and exits 2).
"""

from __future__ import annotations

import argparse
import difflib
import enum
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from hetserve.config_sections import (
    KV_CACHE_DTYPES,
    PREFILL_ATTENTION_DTYPES,
    CacheConfig,
    DisaggConfig,
    KVLoad,
    KVSave,
    LoRAConfig,
    MoEConfig,
    PreemptionMode,
    Role,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
)
from hetserve.errors import InvalidInputError

__all__ = [  # the sections' names too: callers import every config name from here
    "ENGINE_OPTIONS", "KV_CACHE_DTYPES", "CacheConfig", "DisaggConfig", "EngineConfig",
    "EngineOption", "KVLoad", "KVSave", "LoRAConfig", "MoEConfig", "PreemptionMode", "Role",
    "SchedulerConfig", "SchedulingPolicy", "SpeculativeConfig", "add_engine_args",
]  # fmt: skip


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF directory; None = the embedded demo model
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    # Decode forwards run eagerly even on CUDA (no graphs captured): for debugging and to
    # measure what the graphs buy.
    enforce_eager: bool = False
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    moe: MoEConfig = MoEConfig()
    lora: LoRAConfig = LoRAConfig()
    disagg: DisaggConfig = DisaggConfig()
    speculative: SpeculativeConfig | None = None  # None: decode one token a step
    # Host bytes the model (weights, KV cache, runtime) may take; a model estimated above it
    # is refused before any weight is read (core/memory.py). None: no limit.
    max_host_memory: int | None = None

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_host_memory is not None and self.max_host_memory < 1:
            raise ValueError(f"max_host_memory must be >= 1, got {self.max_host_memory}")

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """From keyword arguments named as in ENGINE_OPTIONS (`LLM(...)`'s convenience form);
        an unknown name is a TypeError naming the closest known one."""
        by_name = {o.name: o for o in ENGINE_OPTIONS}
        for name in options:
            if name not in by_name:
                close = difflib.get_close_matches(name, by_name, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"unknown engine option {name!r}{hint}")
            _check_type(by_name[name], options[name])
        return _build({o: options[o.name] for o in ENGINE_OPTIONS if o.name in options})

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        """From flags added by `add_engine_args` (options a command did not add keep their
        defaults)."""
        values = {o: getattr(args, o.name) for o in ENGINE_OPTIONS if hasattr(args, o.name)}
        return _build(values, flags=True)


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one object per option
class EngineOption:
    name: str  # keyword of LLM(...) and argparse dest
    section: str | None  # None (EngineConfig itself) or a section: "cache", "scheduler", ...
    attr: str  # the field it sets in that section
    help: str
    type: Callable[[str], Any] | None = None
    flag: str | None = None  # default: --name-with-dashes
    convert: Callable[[Any], Any] | None = None  # option value -> field value
    store_false: bool = False  # a flag that turns the field off
    choices: tuple[str, ...] | tuple[int, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def default(self) -> Any:
        """The config field's own default: defaults live in the dataclasses alone."""
        cls = {
            None: EngineConfig,
            "cache": CacheConfig,
            "scheduler": SchedulerConfig,
            "lora": LoRAConfig,
            "disagg": DisaggConfig,
        }.get(self.section, MoEConfig)
        return next(f.default for f in fields(cls) if f.name == self.attr)


def _check_type(o: EngineOption, value: Any) -> None:
    """A keyword's Python type, as its flag's parser would give it: else a comparison deep in a
    config's checks fails without naming the option, or a string passes as True."""
    if o.store_false or o.extra.get("action") == "store_true":
        kinds: tuple[type, ...] = (bool,)
        what = "True or False"
    elif o.type is int:
        kinds, what = (numbers.Integral,), "an int"
    elif o.type is float:
        kinds, what = (numbers.Real,), "a number"
    else:
        return
    wrong = not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)
    if value is not None and wrong:
        raise TypeError(f"engine option {o.name!r} takes {what}, got {value!r}")


def _gib(value: float | None) -> int | None:
    return None if value is None else int(float(value) * (1 << 30))


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def _size(value: str | int | None) -> int | None:
    """'64G' -> bytes (binary units); an int is bytes already."""
    if value is None or isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise InvalidInputError(f"--max-host-memory takes a size like 64G or 512M, got {value!r}")
    return int(float(m.group(1)) * (1 << (10 * " kmgt".index(m.group(2).lower() or " "))))


def _lora_modules(value: Any) -> tuple[tuple[str, str], ...]:
    """`NAME=DIR` strings (the flag), or a {name: dir} mapping / (name, dir) pairs (Python)."""
    if isinstance(value, dict):
        return tuple((str(k), str(v)) for k, v in value.items())
    pairs = []
    for item in value or ():
        if isinstance(item, str):
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise InvalidInputError(
                    f"--lora-modules takes NAME=DIR pairs, got {item!r}; e.g. sql=/adapters/sql "
                    "(it takes every value after it: put a command's prompts before it)"
                )
            item = (name, path)
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise InvalidInputError(f"lora_modules entries are (name, directory), got {item!r}")
        pairs.append((str(item[0]), str(item[1])))
    return tuple(pairs)


def _speculative(value: Any) -> SpeculativeConfig | None:
    try:
        return SpeculativeConfig.parse(value)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"--speculative-config: {exc}") from None


ENGINE_OPTIONS: tuple[EngineOption, ...] = (
    EngineOption("model", None, "model", "HF model directory (default: the demo model)"),
    EngineOption("device", None, "device", "auto, cpu or cuda[:N]"),
    EngineOption("dtype", None, "dtype", "auto (fp32 on CPU, bf16 on CUDA), float32, bf16"),
    EngineOption("max_model_len", None, "max_model_len", "context limit in tokens", int),
    EngineOption(
        "enforce_eager", None, "enforce_eager",
        "decode without CUDA graphs (they are captured per batch-size bucket on CUDA)",
        extra={"action": "store_true"},
    ),
    EngineOption(
        "max_host_memory", None, "max_host_memory",
        "host memory the model may take (weights, KV cache, runtime), e.g. 64G; a model that "
        "will not fit is refused before loading", convert=_size, extra={"metavar": "SIZE"},
    ),
    EngineOption(
        "speculative_config", None, "speculative",
        'speculative decoding as JSON (vLLM\'s keys): {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} drafts '
        "from the sequence's own earlier tokens and checks them in one forward; the output is "
        "decoding's. Each sequence checks only drafts that pay by its acceptance and the "
        'measured cost of checking them ("adaptive": false: every draft found)',
        convert=_speculative, extra={"metavar": "JSON"},
    ),
    EngineOption("block_size", "cache", "block_size", "tokens per KV block", int),
    EngineOption("num_kv_blocks", "cache", "num_blocks", "KV blocks (overrides the size)", int),
    EngineOption(
        "kv_cache_gb", "cache", "kv_cache_bytes", "KV cache size in GiB", float, convert=_gib
    ),
    EngineOption(
        "kv_cache_dtype", "cache", "kv_cache_dtype",
        "dtype the KV cache is stored in (the model computes in its own); auto: float16 on "
        "a CPU under the all-int8 placement, else the model's; int8 and fp8 (e4m3) keep an "
        "fp32 scale per token and KV head",
        choices=KV_CACHE_DTYPES,
    ),
    EngineOption(
        "prefill_attention_dtype", "cache", "prefill_attention_dtype",
        "what CPU prefill attention multiplies in: bfloat16 (q, K, the weights and V rounded "
        "to bf16, fp32 sums; AVX512-BF16 CPUs) or float32; auto: bfloat16 where the linears "
        "are int8 (all-int8) and the KV cache 16-bit, as all-int8's default",
        choices=PREFILL_ATTENTION_DTYPES,
    ),
    EngineOption(
        "enable_prefix_caching",
        "cache",
        "enable_prefix_caching",
        "turn off the prefix cache",
        flag="--no-prefix-caching",
        store_false=True,
    ),
    EngineOption(
        "kv_store", "cache", "kv_store",
        "KV store behind the prefix cache: local://?dram=4G&ssd_dir=DIR&ssd=64G, "
        "pool://HOST:PORT, mooncake://HOST:PORT?metadata=URL, redis://HOST:PORT/DB",
        extra={"metavar": "SPEC"},
    ),
    EngineOption(
        "kv_save", "cache", "kv_save",
        "when blocks reach the store: auto (write-through for shared stores), write-back "
        "(before eviction) or write-through (prompt blocks once computed)",
        choices=tuple(m.value for m in KVSave),
    ),
    EngineOption(
        "kv_load", "cache", "kv_load",
        "auto: load stored blocks only where predicted faster than recomputing them; always: "
        "load whatever is found", choices=tuple(m.value for m in KVLoad),
    ),
    EngineOption(
        "session_ttl", "cache", "session_ttl_s",
        "seconds a session's KV blocks are kept from eviction after its request ends "
        "(requests with a session_id)", float,
    ),
    EngineOption(
        "state_checkpoint_every", "cache", "state_checkpoint_every",
        "linear-attention models: keep a prefix checkpoint of the layers' state every N blocks",
        int,
    ),
    EngineOption(
        "state_checkpoints", "cache", "state_checkpoints",
        "linear-attention models: state slots kept for prefix checkpoints (default: "
        "max_num_seqs)", int,
    ),
    EngineOption(
        "kv_events", "cache", "kv_events",
        "publish KV events (vLLM's format: msgpack batches on ZMQ PUB, replay on PORT+1) here; "
        "beyond loopback they need --api-key", extra={"metavar": "tcp://HOST:PORT"},
    ),
    EngineOption(
        "kv_events_replay", "cache", "kv_events_replay",
        "the KV events' replay socket (default: the --kv-events port + 1)",
        extra={"metavar": "tcp://HOST:PORT"},
    ),
    EngineOption(
        "kv_events_token", "cache", "kv_events_token",
        "shared token of the KV event sockets", flag="",  # serve passes its API key
    ),
    EngineOption("max_num_seqs", "scheduler", "max_num_seqs", "sequences per step", int),
    EngineOption(
        "max_num_batched_tokens", "scheduler", "max_num_batched_tokens", "tokens per step",
        int,
    ),
    EngineOption(
        "max_step_ms", "scheduler", "max_step_ms",
        "milliseconds a step with decodes may take: prompt chunks are sized by the measured "
        "step time to fit (inf: by tokens alone; default: the shortest step that keeps a "
        "prompt at 80%% of its speed alone)", float,
    ),
    EngineOption(
        "slo_tbt_ms", "scheduler", "slo_tbt_ms",
        "inter-token latency target in ms; steps with decodes are held to 0.8 of it "
        "(--max-step-ms wins where given)", float,
    ),
    EngineOption(
        "preemption_mode", "scheduler", "preemption_mode",
        "what a preempted request keeps: recompute (nothing: computed again) or swap (its KV "
        "and linear-attention state copied to host memory and back)",
        choices=tuple(m.value for m in PreemptionMode),
    ),
    EngineOption(
        "swap_space_gb", "scheduler", "swap_space_gb",
        "host memory for preemption by swap (GiB)", float,
    ),
    EngineOption(
        "scheduling_policy", "scheduler", "policy", "fcfs, or priority (lower runs first)",
        choices=tuple(m.value for m in SchedulingPolicy),
    ),
    EngineOption(
        "placement", "moe", "placement",
        "where modules run: auto (no accelerator: all-int8; else device if the model fits "
        "with its KV cache, else hybrid), device (every weight on the engine device in its "
        "dtype: exact), hybrid (routed experts on the CPU int8 kernel, the rest on the engine "
        "device; alias default), all-int8 (CPU only: experts and linears on the int8 kernels), "
        "or a YAML rules file", extra={"metavar": "auto|device|hybrid|all-int8|RULES.yaml"},
    ),
    EngineOption(
        "gpu_experts", "moe", "gpu_experts",
        "keep the N most-routed experts of each layer on the engine device", int,
    ),
    EngineOption(
        "routing_stats", "moe", "routing_stats",
        "routing statistics JSON (from `hetserve calibrate`)", extra={"metavar": "FILE"},
    ),
    EngineOption(
        "cpu_threads", "moe", "cpu_threads", "threads of the dedicated CPU-experts pool", int
    ),
    EngineOption(
        "numa", "moe", "numa",
        "auto: split each layer's CPU experts across the NUMA nodes (memory bound to the node, "
        "one pinned thread team per node); off, or a one-node machine: no split",
        choices=("off", "auto"),
    ),
    EngineOption(
        "activation_bits", "moe", "activation_bits",
        "bits the int8 kernels round activations to per token: 16 (default) or 8 (W8A8: "
        "int8 x int8, about twice the prefill GEMM rate, a larger logprob error)", int,
        choices=(8, 16),
    ),
    EngineOption(
        "max_deferred_experts_per_token", "moe", "max_deferred_experts_per_token",
        "expert deferral: this many low-weight experts per token run one layer late", int,
    ),
    EngineOption(
        "record_routing_stats", "moe", "record_routing_stats",
        "count every routing decision (read them with routing_stats())",
        flag="",  # set by commands (calibrate, serve --save-routing-stats), not a flag
    ),
    EngineOption(
        "lora_modules", "lora", "lora_modules",
        "LoRA adapters (PEFT directories) to serve; a request's model field picks one by NAME",
        convert=_lora_modules, extra={"nargs": "+", "metavar": "NAME=DIR"},
    ),
    EngineOption(
        "max_loras", "lora", "max_loras",
        "LoRA adapters resident at once (a step with more runs in parts)", int,
    ),
    EngineOption(
        "max_lora_rank", "lora", "max_lora_rank", "largest LoRA rank accepted", int
    ),
    EngineOption(
        "enable_lora", "lora", "enable_lora",
        "install LoRA layers though no adapter is named yet (implied by --lora-modules and "
        "--enable-lora-runtime-updates)", extra={"action": "store_true"},
    ),
    EngineOption(
        "role", "disagg", "role",
        "prefill: compute prompts and hand their KV to decode instances; decode: receive it "
        "and generate; both: everything here", choices=tuple(m.value for m in Role),
    ),
    EngineOption(
        "handoff_listen", "disagg", "handoff_listen",
        "HOST:PORT where hand-offs are received (decode and both; port 0: any free port)",
        extra={"metavar": "HOST:PORT"},
    ),
    EngineOption(
        "handoff_links", "disagg", "handoff_links",
        "TCP connections a hand-off to another host is striped over", int,
    ),
    EngineOption(
        "handoff_mooncake", "disagg", "handoff_mooncake",
        "also hand KV off through Mooncake's Transfer Engine (pip install 'hetserve[mooncake]')",
        extra={"action": "store_true"},
    ),
)  # fmt: skip


def add_engine_args(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Add every engine option as a flag; `defaults` overrides a command's defaults."""
    groups = {
        None: parser.add_argument_group("model"),
        "cache": parser.add_argument_group("KV cache"),
        "scheduler": parser.add_argument_group("scheduler"),
        "moe": parser.add_argument_group("mixture of experts"),
        "lora": parser.add_argument_group("LoRA adapters"),
        "disagg": parser.add_argument_group("prefill/decode disaggregation"),
    }
    for o in ENGINE_OPTIONS:
        if o.flag == "":
            continue
        default = defaults.get(o.name, o.default)
        quiet = default in (None, (), False) or o.store_false
        value = default.value if isinstance(default, enum.Enum) else default  # KVLoad.AUTO: auto
        shown = "" if quiet else f" (default: {value})"
        kw: dict[str, Any] = {"dest": o.name, "help": o.help + shown, **o.extra}
        if o.store_false:  # --no-X: a flag that turns on the default's opposite
            kw["action"] = "store_false"
        elif "action" not in o.extra:
            kw.update(type=o.type, choices=o.choices)
        groups[o.section].add_argument(o.cli_flag, default=default, **kw)


_SECTIONS = (None, "cache", "scheduler", "moe", "lora", "disagg")


def _build(values: dict[EngineOption, Any], flags: bool = False) -> EngineConfig:
    """`flags`: from the command line, whose errors name the flags, not the fields."""
    sections: dict[str | None, dict[str, Any]] = {s: {} for s in _SECTIONS}
    for o, value in values.items():
        sections[o.section][o.attr] = o.convert(value) if o.convert else value
    try:
        return EngineConfig(
            **sections[None],
            cache=CacheConfig(**sections["cache"]),
            scheduler=SchedulerConfig(**sections["scheduler"]),
            moe=MoEConfig(**sections["moe"]),
            lora=LoRAConfig(**sections["lora"]),
            disagg=DisaggConfig(**sections["disagg"]),
        )
    except ValueError as exc:  # the CLI prints a HetserveError as one line and exits 2
        raise InvalidInputError(_as_flag(str(exc)) if flags else str(exc)) from None


def _as_flag(message: str) -> str:
    """A section's message that opens with a field's name, opening with the flag that sets
    it."""
    head, sep, rest = message.partition(" ")
    name = head.rstrip(":")
    for o in ENGINE_OPTIONS:
        if o.attr == name and "_" in name:
            return o.cli_flag + head[len(name) :] + sep + rest
    return message
