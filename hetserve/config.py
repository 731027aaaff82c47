"""Engine configuration: frozen dataclasses, validated once at construction, and the one table
of engine options that every entry point reads.

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
import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from hetserve.errors import InvalidInputError


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"  # arrival order
    PRIORITY = "priority"  # the request's priority (lower first), then arrival


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"  # a preempted request's KV is freed and computed again
    SWAP = "swap"  # copied to host memory (--swap-space-gb) and copied back at resumption


class KVSave(enum.Enum):
    AUTO = "auto"  # write-through of prompt blocks for shared stores, plus write-back
    WRITE_BACK = "write-back"  # blocks about to be evicted
    WRITE_THROUGH = "write-through"  # prompt blocks once computed


class KVLoad(enum.Enum):
    AUTO = "auto"  # a found run only where loading is predicted faster than recomputing
    ALWAYS = "always"  # whatever is found


def _as_enum(obj: object, name: str, cls: type[enum.Enum]) -> None:
    """Accept a member or its value (flags and keywords give strings) for a frozen field."""
    value = getattr(obj, name)
    if isinstance(value, cls):
        return
    try:
        object.__setattr__(obj, name, cls(value))
    except ValueError:
        allowed = ", ".join(str(m.value) for m in cls)
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}") from None


# Values of --kv-cache-dtype (torch dtype names; "auto": float16 for an fp32 model on the CPU
# under the all-int8 preset, else the model's dtype (model/build.py's kv_dtype);
# int8 and fp8 (e4m3) keep an fp32 scale per token and KV head beside the rows).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "int8", "fp8")

CPU_KV_CAP_BYTES = 2 << 30  # the KV budget on CPU when none is given (CacheConfig below)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # KV memory: an explicit block count wins; else `kv_cache_bytes`; else enough blocks for
    # max_num_seqs full-length sequences (capped at 2 GiB on CPU).
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    hash_seed: str = ""  # an operator's salt in every block's identity
    # The dtype the paged KV cache stores (the model computes in its own): "auto" = the model's
    # dtype (see `hetserve.kv.paged.resolve_kv_dtype` for why not 16-bit on CPU yet).
    kv_cache_dtype: str = "auto"
    # A KV store behind the prefix cache (any hetserve.store spec), and when blocks are saved
    # there: "auto" = write-through of prompt blocks for shared stores (pool, mooncake, redis)
    # plus write-back of blocks about to be evicted; write-back alone for a local store.
    kv_store: str | None = None
    kv_save: KVSave = KVSave.AUTO
    # "auto": load a found run only where that is predicted faster than recomputing it;
    # "always": load whatever is found (saves compute when a marginally slower TTFT is fine).
    kv_load: KVLoad = KVLoad.AUTO
    # A request with a session_id keeps its blocks from eviction this long after it ends (while
    # other free blocks exist), so the session's next turn finds them: agentic traffic.
    session_ttl_s: float = 600.0
    # Models with linear-attention layers: prefix caching keeps the layers' state at the end of
    # every `state_checkpoint_every`-th block, in `state_checkpoints` slots (None: one per
    # max_num_seqs) beside the running requests' own.
    state_checkpoint_every: int = 4
    state_checkpoints: int | None = None
    # KV events in vLLM's format on ZMQ (`disagg/kv_publisher.py`): tcp://HOST:PORT of the PUB
    # socket, the replay socket (default PORT+1), and the shared token that secures them beyond
    # loopback (the server's API key; not a flag of its own).
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError("the KV cache size must be positive")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            allowed, got = ", ".join(KV_CACHE_DTYPES), self.kv_cache_dtype
            raise ValueError(f"kv_cache_dtype must be one of {allowed}, got {got!r}")
        _as_enum(self, "kv_save", KVSave)
        _as_enum(self, "kv_load", KVLoad)
        if self.session_ttl_s < 0:
            raise ValueError("session_ttl_s must be >= 0")
        if self.state_checkpoint_every < 1:
            raise ValueError("state_checkpoint_every must be >= 1 (blocks)")
        if self.state_checkpoints is not None and self.state_checkpoints < 0:
            raise ValueError("state_checkpoints must be >= 0")
        if self.kv_store is not None and not self.enable_prefix_caching:
            raise ValueError("a KV store works behind the prefix cache; do not turn it off")
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ValueError("kv_events_replay needs kv_events")
        if self.kv_events is not None:
            hosts = [tcp_endpoint(e)[0] for e in (self.kv_events, self.kv_events_replay) if e]
            if not self.kv_events_token and not all(is_loopback_host(h) for h in hosts):
                raise ValueError(
                    f"KV events bound beyond loopback ({self.kv_events}) need a shared token: "
                    "pass --api-key (or set HETSERVE_API_KEY), or bind 127.0.0.1"
                )


def tcp_endpoint(endpoint: str) -> tuple[str, int]:
    """`tcp://HOST:PORT` -> (host, port); ValueError naming it otherwise. Port 0 or `*` means a
    free port."""
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    port = "0" if port == "*" else port
    if not endpoint.startswith("tcp://") or not sep or not host or not port.isdigit():
        raise ValueError(f"expected a tcp://HOST:PORT address, got {endpoint!r}")
    if int(port) > 65535:
        raise ValueError(f"port {port} of {endpoint!r} is out of range")
    return host, int(port)


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # tokens per step, an upper bound in every step
    enable_chunked_prefill: bool = True
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    # The time a step with decodes may take (a prompt chunk gets what the decodes leave of it,
    # by the engine's measured step time); inf: chunks by tokens alone. Else derived from the
    # inter-token SLO; neither: as short as keeps a prompt beside decodes at 80% of its speed
    # alone (sched/step_budget.py).
    max_step_ms: float | None = None
    slo_tbt_ms: float | None = None
    # Preemption by swap keeps a request's KV (and a linear-attention model's state) in up to
    # this much host memory; a request that does not fit is preempted by recompute.
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    swap_space_gb: float = 4.0

    def __post_init__(self) -> None:
        _as_enum(self, "preemption_mode", PreemptionMode)
        if not self.swap_space_gb >= 0:
            raise ValueError(f"swap_space_gb must be >= 0, got {self.swap_space_gb}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        _as_enum(self, "policy", SchedulingPolicy)
        for name in ("max_step_ms", "slo_tbt_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:  # also refuses NaN
                raise ValueError(f"{name} must be > 0 (inf: no limit), got {value}")
        step, slo = self.max_step_ms, self.slo_tbt_ms
        if step is not None and slo is not None and step > slo:
            raise ValueError(
                f"max_step_ms ({step:g}) must not exceed slo_tbt_ms ({slo:g}): every step "
                "with decodes is an inter-token gap"
            )


@dataclass(frozen=True)
class MoEConfig:
    # Per token, this many lowest-weighted routed experts of MoE layer L run while layer L+1
    # computes (never in the last MoE layer). 0 = exact.
    max_deferred_experts_per_token: int = 0
    # Where each module runs (moe/presets.py): "auto" picks a preset for this machine and model
    # (no accelerator: all-int8); "device" = every module on the engine device in its dtype
    # (exact; None means the same); "hybrid" (alias "default") = routed experts on the CPU int8
    # kernel, the rest on the engine device; "all-int8" = CPU only, every linear int8; or a
    # path to a YAML rules file.
    placement: str = "auto"
    gpu_experts: int = 0  # hottest experts per layer kept on the engine device
    routing_stats: str | None = None  # JSON from `hetserve calibrate` (needed by gpu_experts)
    cpu_threads: int | None = None  # threads of the dedicated CPU-experts pool
    record_routing_stats: bool = False  # count routing decisions (EngineCore.routing_stats())
    # "auto": on a machine with 2+ NUMA nodes, each layer's CPU experts are split across the
    # nodes (memory bound there, one pinned thread team per node: moe/numa_experts.py);
    # "off" (default), or one node: one backend on every CPU, as before.
    numa: str = "off"

    def __post_init__(self) -> None:
        if self.max_deferred_experts_per_token < 0:
            raise ValueError("max_deferred_experts_per_token must be >= 0")
        if self.gpu_experts < 0:
            raise ValueError("gpu_experts must be >= 0")
        if self.placement is None:  # the reference: nothing placed off the engine device
            object.__setattr__(self, "placement", "device")
        if self.gpu_experts and self.placement == "device":
            raise ValueError(
                "gpu_experts needs a placement that puts the routed experts off the engine "
                "device (e.g. placement='hybrid')"
            )
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError("cpu_threads must be >= 1")
        if self.numa not in ("off", "auto"):
            raise ValueError(f"numa must be one of off, auto, got {self.numa!r}")


@dataclass(frozen=True)
class LoRAConfig:
    """Serving LoRA adapters (PEFT format). LoRA layers are installed when `enable_lora` is set
    or adapters are named; `max_loras` adapters are resident in the layers' slots at once (one
    step runs at most that many; a batch with more is split), the rest wait in host memory."""

    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, adapter directory) loaded at start
    max_loras: int = 4
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        names = [n for n, _ in self.lora_modules]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"LoRA adapter name {dup!r} is given twice; names must be unique")

    @property
    def enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)


class Role(enum.Enum):
    """An instance's part in a prefill/decode cluster."""

    PREFILL = "prefill"  # computes prompts and hands their KV to decode instances
    DECODE = "decode"  # receives prompts' KV and generates
    BOTH = "both"  # does both, alone or in a cluster (colocated)

    @property
    def prefills(self) -> bool:
        return self is not Role.DECODE

    @property
    def decodes(self) -> bool:
        return self is not Role.PREFILL


@dataclass(frozen=True)
class DisaggConfig:
    """Prefill/decode disaggregation: this instance's role and its hand-off endpoints."""

    role: Role = Role.BOTH
    # Where a decode-capable instance receives hand-offs pushed to it (port 0: any free one).
    handoff_listen: str = "127.0.0.1:0"
    handoff_staging_bytes: int = 256 << 20  # received KV waiting for its request
    handoff_links: int = 2  # TCP connections a hand-off is striped over (between hosts)
    handoff_mooncake: bool = False  # also hand off through Mooncake's Transfer Engine

    def __post_init__(self) -> None:
        _as_enum(self, "role", Role)
        host, _, port = self.handoff_listen.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError(f"handoff_listen must be HOST:PORT, got {self.handoff_listen!r}")
        if self.handoff_staging_bytes < 1 << 20:
            raise ValueError("handoff staging must hold at least 1 MiB")
        if not 1 <= self.handoff_links <= 16:
            raise ValueError(f"handoff_links must be 1..16, got {self.handoff_links}")


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
        return _build({o: options[o.name] for o in ENGINE_OPTIONS if o.name in options})

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        """From flags added by `add_engine_args` (options a command did not add keep their
        defaults)."""
        return _build({o: getattr(args, o.name) for o in ENGINE_OPTIONS if hasattr(args, o.name)})


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
    choices: tuple[str, ...] | None = None
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
                    f"--lora-modules takes NAME=DIR pairs, got {item!r}; e.g. sql=/adapters/sql"
                )
            item = (name, path)
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise InvalidInputError(f"lora_modules entries are (name, directory), got {item!r}")
        pairs.append((str(item[0]), str(item[1])))
    return tuple(pairs)


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
    EngineOption("block_size", "cache", "block_size", "tokens per KV block", int),
    EngineOption("num_kv_blocks", "cache", "num_blocks", "KV blocks (overrides the size)", int),
    EngineOption(
        "kv_cache_gb", "cache", "kv_cache_bytes", "KV cache size in GiB", float, convert=_gib
    ),
    EngineOption(
        "kv_cache_dtype", "cache", "kv_cache_dtype",
        "dtype the KV cache is stored in (the model computes in its own); auto: the model's; "
        "int8 and fp8 (e4m3) keep an fp32 scale per token and KV head",
        choices=KV_CACHE_DTYPES,
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
        shown = "" if quiet else f" (default: {default})"
        kw: dict[str, Any] = {"dest": o.name, "help": o.help + shown, **o.extra}
        if o.store_false:  # --no-X: a flag that turns on the default's opposite
            kw["action"] = "store_false"
        elif "action" not in o.extra:
            kw.update(type=o.type, choices=o.choices)
        groups[o.section].add_argument(o.cli_flag, default=default, **kw)


_SECTIONS = (None, "cache", "scheduler", "moe", "lora", "disagg")


def _build(values: dict[EngineOption, Any]) -> EngineConfig:
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
        raise InvalidInputError(str(exc)) from None
