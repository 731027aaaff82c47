"""What a cluster runs: `ClusterSpec` (the user's options) and `plan`, which turns it into its
parts in start order, each with the command it runs.

Who calls it: the launchers (disagg/launch.py here, disagg/ray_launch.py on Ray's nodes) and
`hetserve cluster up` (the spec from its flags or YAML). No I/O: a part's command is built when
a launcher starts it (`Part.build`), from its own host and port and the addresses of the parts
started before it, so a part moved to another port or node is found where it is.

Failure contract: a `ClusterSpec` that cannot run raises `ValueError` naming the option.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

LAUNCHERS = ("local", "ray")
INSTANCE_ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class ClusterSpec:
    model: str | None = None  # None: the demo model
    prefill: int = 1
    decode: int = 1
    both: int = 0
    store: str = "none"  # "none" or "pool"
    store_dram: str = "1G"  # per store node
    port: int = 8000  # the Conductor's; the others take free ports
    policy: str = "kvcentric"
    admission: str = "none"
    slo_ttft_ms: float | None = None
    slo_tbt_ms: float | None = None
    handoff_path: str = "direct"
    instance_args: tuple[str, ...] = ()  # extra engine options for every instance
    # Engine options for one role's instances, after instance_args (a prefill box's placement
    # beside a decode box's), e.g. {"prefill": ("--placement", "device")}.
    role_args: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    log_requests: str | None = None  # a directory: each part's request log (hetserve sim's)
    log_dir: str = "hetserve-cluster-logs"
    restart: bool = True  # start a part that exits again (`supervise`)
    host: str = "127.0.0.1"  # the Conductor's bind address
    api_key: str | None = None  # the clients' key; with Ray every part's (made up if None)
    launcher: str = "local"  # "local" (processes here) or "ray" (on a Ray cluster's nodes)
    ray_address: str | None = None  # "auto" or HOST:PORT; None: a Ray instance started here
    # Ray resources each instance of a role needs, e.g. {"decode": {"CPU": 16, "big_box": 1}}.
    ray_resources: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.store not in ("none", "pool"):
            raise ValueError(f"store must be none or pool, got {self.store!r}")
        if min(self.prefill, self.decode, self.both) < 0:
            raise ValueError("instance counts must be >= 0")
        if not (self.prefill and self.decode) and not self.both:
            raise ValueError("give prefill and decode instances, or colocated (both) ones")
        if self.handoff_path == "store" and self.store == "none":
            raise ValueError("--handoff-path store needs --store pool")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be local or ray, got {self.launcher!r}")
        for role in self.role_args:
            if role not in INSTANCE_ROLES:
                raise ValueError(f"role_args: {role!r} is no instance role (prefill, decode, both)")
        if self.ray_resources and self.launcher != "ray":
            raise ValueError("ray_resources are for --launcher ray")
        for role, needs in self.ray_resources.items():
            if not isinstance(needs, Mapping):
                raise ValueError(f"ray_resources: {role}: want a mapping of resource: amount")
            if role not in INSTANCE_ROLES:
                raise ValueError(
                    f"ray_resources: {role!r} is no instance role (prefill, decode, both)"
                )
            for name, amount in needs.items():
                number = isinstance(amount, int | float) and not isinstance(amount, bool)
                if not number or not amount >= 0:
                    raise ValueError(
                        f"ray_resources: {role} {name}: {amount!r} should be a number >= 0"
                    )


class Proc(Protocol):
    """A started part's process: a `subprocess.Popen` here, a handle on a Ray node's."""

    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


@dataclass
class Part:
    name: str
    cmd: list[str] = field(default_factory=list)
    url: str | None = None  # answered /health when ready; else a TCP port
    port: int = 0  # 0: a free one, chosen where it runs when it starts
    chosen: bool = True  # its port is a free one picked by the launcher (not the user's --port)
    build: Callable[[Part], list[str]] | None = None  # its command, from its host and port
    http: bool = False  # it answers /health (else: it listens on its port)
    role: str = ""  # an instance's role; "" for the others
    host: str = "127.0.0.1"  # where it listens
    env: dict[str, str] = field(default_factory=dict)  # beyond the launcher's environment
    dirs: list[str] = field(default_factory=list)  # made where it runs before it starts
    proc: Proc | None = None
    log: Path | None = None
    started_at: float = 0.0  # time.monotonic() of its last start
    restarts: int = 0
    backoff_s: float = 0.0  # the wait before its last restart (0 before any)
    restart_at: float | None = None  # it exited: when it starts again

    @property
    def address(self) -> str:
        return f"{bracket(self.host)}:{self.port}"


def bracket(host: str) -> str:
    """`host` as it goes before `:port` (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


def plan(spec: ClusterSpec, python: str, store_nodes: int = 1) -> list[Part]:
    """The parts of `spec` in start order. Each one's command is built as it starts (`build`),
    from its host and port and the addresses of the parts started before it, so a part moved
    to another port (or node) is found where it is. `store_nodes`: one per host that holds KV
    (the Ray launcher's), else one."""
    py = [python, "-m"]
    parts: list[Part] = []
    model = ["--model", spec.model] if spec.model else []
    master: Part | None = None

    def store_node(p: Part) -> list[str]:
        assert master is not None
        return [*py, "hetserve.entrypoints.store", "node", "--master", master.address, "--dram",
                spec.store_dram, "--host", p.host, "--port", str(p.port)]  # fmt: skip

    if spec.store == "pool":
        master = Part("store-master", build=lambda p: [
            *py, "hetserve.entrypoints.store", "master", "--host", p.host, "--port", str(p.port)
        ])  # fmt: skip
        parts.append(master)
        for i in range(store_nodes):
            name = "store-node" if store_nodes == 1 else f"store-node-{i}"
            parts.append(Part(name, build=store_node))

    def instance(p: Part) -> list[str]:
        host = bracket(p.host)
        # KV events on free ports (kv_info names them): the Conductor's KV index.
        cmd = [*py, "hetserve.cli", "serve", *model, "--role", p.role, "--host", p.host,
               "--port", str(p.port), "--kv-events", f"tcp://{host}:0", "--handoff-listen",
               f"{host}:0"]  # fmt: skip
        if master is not None:
            cmd += ["--kv-store", f"pool://{master.address}"]
        if spec.handoff_path == "mooncake":
            cmd += ["--handoff-mooncake"]
        cmd += [*spec.instance_args, *spec.role_args.get(p.role, ())]
        if spec.log_requests is not None:
            cmd += ["--log-requests", str(Path(spec.log_requests) / f"{p.name}.jsonl")]
        return cmd

    instances = [
        Part(f"{role}-{i}", build=instance, http=True, role=role)
        for role, n in (("prefill", spec.prefill), ("decode", spec.decode), ("both", spec.both))
        for i in range(n)
    ]
    parts += instances

    def conductor(p: Part) -> list[str]:
        cmd = [*py, "hetserve.cli", "conductor", *model, "--host", p.host, "--port",
               str(p.port), "--policy", spec.policy, "--admission", spec.admission,
               "--handoff-path", spec.handoff_path]  # fmt: skip
        for role in INSTANCE_ROLES:
            urls = [str(q.url) for q in instances if q.role == role]
            if urls:
                cmd += [f"--{role}", *urls]
        if spec.slo_ttft_ms is not None:
            cmd += ["--slo-ttft-ms", str(spec.slo_ttft_ms)]
        if spec.slo_tbt_ms is not None:
            cmd += ["--slo-tbt-ms", str(spec.slo_tbt_ms)]
        if spec.log_requests is not None:
            cmd += ["--log-requests", str(Path(spec.log_requests) / "conductor.jsonl")]
        return cmd

    parts.append(Part("conductor", build=conductor, http=True, host=spec.host, port=spec.port,
                      chosen=False))  # fmt: skip
    if spec.log_requests is not None:  # serve and conductor want its directory to exist
        for part in parts[-len(instances) - 1 :]:
            part.dirs.append(spec.log_requests)
    return parts
