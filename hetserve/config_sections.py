"""The engine configuration's sections: frozen dataclasses for the KV cache, the scheduler,
routed experts, LoRA adapters and prefill/decode disaggregation, with the enums their fields
take, each validated once at construction (a bad value is a ValueError naming the field).

Who uses it: hetserve/config.py, whose EngineConfig holds one of each and whose option table
sets their fields (most callers import these names from there); the engine, scheduler, KV
manager and servers read them. Pure data: no I/O.
"""

from __future__ import annotations

import enum
import ipaddress
import json
from dataclasses import dataclass, field


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
# Values of --prefill-attention-dtype: what the CPU prefill-attention kernel multiplies in
# (model/build.py's prefill_bf16; "auto": bfloat16 where the KV cache is 16-bit, the dense
# linears run on the int8 kernels (all-int8) and the build has vdpbf16ps, else float32).
PREFILL_ATTENTION_DTYPES = ("auto", "float32", "bfloat16")

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
    prefill_attention_dtype: str = "auto"  # PREFILL_ATTENTION_DTYPES
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
        if self.prefill_attention_dtype not in PREFILL_ATTENTION_DTYPES:
            allowed, got = ", ".join(PREFILL_ATTENTION_DTYPES), self.prefill_attention_dtype
            raise ValueError(f"prefill_attention_dtype must be one of {allowed}, got {got!r}")
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
            hosts = []
            for name in ("kv_events", "kv_events_replay"):
                value = getattr(self, name)
                if value:
                    try:
                        hosts.append(tcp_endpoint(value)[0])
                    except ValueError as exc:
                        raise ValueError(f"{name}: {exc}") from None
            if not self.kv_events_token and not all(is_loopback_host(h) for h in hosts):
                raise ValueError(
                    f"KV events bound beyond loopback ({self.kv_events}) need a shared token: "
                    "publish them from `hetserve serve --api-key` (or HETSERVE_API_KEY), whose "
                    "key is that token, or bind 127.0.0.1"
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
    # Bits the int8 kernels round activations to, per token row: 16 (default: int16 x int8, the
    # activation error far below the weights') or 8 (W8A8: bytes times bytes, vpdpbusd / AMX,
    # ~2x the GEMM rate at prefill; the logprob error in docs/benchmarks.md). Routed experts on
    # cpu-int8 and the dense int8 linears alike.
    activation_bits: int = 16

    def __post_init__(self) -> None:
        if self.activation_bits not in (8, 16):
            raise ValueError(f"activation_bits must be 8 or 16, got {self.activation_bits}")
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


SPECULATIVE_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `--speculative-config`): each decoding sequence's next
    `num_speculative_tokens` tokens are drafted and checked in one forward; the output is the
    one decoding would give (engine/speculative.py). `ngram`: drafts are what followed the
    latest earlier occurrence of the sequence's last n tokens, n from `prompt_lookup_max` down
    to `prompt_lookup_min` (core/ngram.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # Each sequence checks as many drafts as pay for themselves by its own acceptance and the
    # measured cost of checking them (core/spec_policy.py), none where none pay; False: as
    # many as the proposer finds, every step (vLLM's behaviour).
    adaptive: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")
        if self.method not in SPECULATIVE_METHODS:
            known = ", ".join(SPECULATIVE_METHODS)
            raise ValueError(f"method {self.method!r} is not supported (known: {known})")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not isinstance(lo, int) or not isinstance(hi, int) or not 1 <= lo <= hi <= 64:
            raise ValueError(
                f"prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max <= 64, "
                f"got {lo!r} and {hi!r}"
            )

    @classmethod
    def parse(cls, value: object) -> SpeculativeConfig | None:
        """From a JSON object (the flag), a mapping (Python) or a SpeculativeConfig; None or
        an empty object: off. vLLM's keys; `prompt_lookup_max` alone sets min to the same
        only where it is below the default min."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"takes a JSON object, e.g. "
                    f'\'{{"method": "ngram", "num_speculative_tokens": 4}}\': {exc.msg}'
                ) from None
        if not isinstance(value, dict):
            raise ValueError(f"takes a JSON object, got {value!r}")
        if not value:
            return None
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "adaptive"}  # fmt: skip
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"unknown key(s) {', '.join(unknown)} "
                f"(known: {', '.join(sorted(known))})"
            )
        args = dict(value)
        if "prompt_lookup_max" in args and "prompt_lookup_min" not in args:
            hi = args["prompt_lookup_max"]
            if isinstance(hi, int) and hi < cls.prompt_lookup_min:
                args["prompt_lookup_min"] = hi
        return cls(**args)
