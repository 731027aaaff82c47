"""`hetserve cluster up`: a whole prefill/decode cluster (`disagg/launch.py`): the pool store,
the instances and the Conductor, on this machine or (`--launcher ray`) on the nodes of a Ray
cluster, each started again if it exits (unless --no-restart), stopped together on Ctrl-C or
SIGTERM."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from hetserve.errors import InvalidInputError


def register(sub) -> None:
    c = sub.add_parser("cluster", help="run a prefill/decode cluster (here, or on Ray nodes)")
    csub = c.add_subparsers(dest="cluster_command", metavar="up", required=True)
    up = csub.add_parser("up", help="start store, instances and Conductor; Ctrl-C stops all")
    up.add_argument("--config", default=None, metavar="YAML", help="the same options as YAML")
    up.add_argument("--model", default=None)
    up.add_argument("--prefill", type=int, default=1)
    up.add_argument("--decode", type=int, default=1)
    up.add_argument("--both", type=int, default=0)
    up.add_argument("--store", default="none", choices=("none", "pool"))
    up.add_argument("--store-dram", default="1G")
    up.add_argument("--port", type=int, default=8000, help="the Conductor's port")
    up.add_argument(
        "--host", default="127.0.0.1", help="the Conductor's bind address (default loopback)"
    )
    up.add_argument(
        "--api-key",
        default=None,
        help="the key clients send (or HETSERVE_API_KEY); with --launcher ray also every "
        "part's, made up and written to LOG_DIR/api-key when not given",
    )
    up.add_argument(
        "--launcher",
        default="local",
        choices=("local", "ray"),
        help="local: every part a process here; ray: on the nodes of a Ray cluster (the "
        "Conductor and store master on this machine's node)",
    )
    up.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="the Ray cluster to join (HOST:PORT, or auto); default: start one here",
    )
    up.add_argument(
        "--ray-resources",
        action="append",
        default=[],
        metavar="ROLE=NAME:N[,NAME:N]",
        help="Ray resources each instance of ROLE (prefill, decode, both) needs, e.g. "
        "decode=CPU:16,big_box:1 (repeatable)",
    )
    up.add_argument("--policy", default="kvcentric")
    up.add_argument("--admission", default="none")
    up.add_argument("--slo-ttft-ms", type=float, default=None)
    up.add_argument("--slo-tbt-ms", type=float, default=None)
    up.add_argument("--handoff-path", default="direct", choices=("direct", "store", "mooncake"))
    up.add_argument("--log-dir", default="hetserve-cluster-logs")
    up.add_argument(
        "--no-restart",
        action="store_true",
        help="leave a part that exits down (by default it starts again, after a back-off of "
        "1 s doubling up to 60 s while it keeps exiting)",
    )
    up.add_argument(
        "--log-requests",
        default=None,
        metavar="DIR",
        help="each instance and the Conductor write their requests to DIR/NAME.jsonl in "
        "hetserve sim's trace format (a digital twin replays them)",
    )
    up.add_argument(
        "--instance-args",
        default="",
        help='extra engine options for every instance, e.g. "--dtype float32"',
    )
    up.add_argument(
        "--role-args",
        action="append",
        default=[],
        metavar="ROLE=OPTIONS",
        help='engine options for one role\'s instances, after --instance-args, e.g. '
        '"prefill=--placement device" (repeatable)',
    )
    up.set_defaults(func=_up)


# The YAML types of `cluster up --config` keys other than strings (a boolean is no number).
_CONFIG_KINDS: dict[str, tuple[type, ...]] = {
    "prefill": (int,), "decode": (int,), "both": (int,), "port": (int,),
    "slo_ttft_ms": (int, float), "slo_tbt_ms": (int, float), "restart": (bool,),
    "ray_resources": (dict,), "role_args": (dict,),
}  # fmt: skip


def _split_role_args(flag: str) -> tuple[str, str]:
    role, eq, options = flag.partition("=")
    if not eq:
        raise InvalidInputError(
            f'--role-args wants ROLE=OPTIONS (e.g. "prefill=--placement device"), got {flag!r}'
        )
    return role, options


def _role_args(given: dict) -> dict[str, tuple[str, ...]]:
    """{"prefill": "--placement device"} as {"prefill": ("--placement", "device")}."""
    import shlex

    out: dict[str, tuple[str, ...]] = {}
    for role, options in given.items():
        if not isinstance(options, str):
            raise InvalidInputError(f"role_args: {role}: want a string of engine options")
        try:
            out[str(role).strip()] = tuple(shlex.split(options))
        except ValueError as exc:
            raise InvalidInputError(f"role_args: {role}: {exc}") from None
    return out


def _instance_args(options: str, where: str) -> tuple[str, ...]:
    import shlex

    try:
        return tuple(shlex.split(options))
    except ValueError as exc:  # an unbalanced quote
        raise InvalidInputError(f"{where}: {exc}") from None


def _resources(flags: list[str]) -> dict[str, dict[str, float]]:
    """`--ray-resources decode=CPU:16,big_box:1` as {"decode": {"CPU": 16, "big_box": 1}}."""
    out: dict[str, dict[str, float]] = {}
    for flag in flags:
        role, _, rest = flag.partition("=")
        try:
            pairs = [item.split(":") for item in rest.split(",")]
            out[role.strip()] = {name.strip(): float(n) for name, n in pairs}
        except ValueError:
            raise InvalidInputError(
                f"--ray-resources wants ROLE=NAME:N[,NAME:N] (e.g. decode=CPU:16), got {flag!r}"
            ) from None
    return out


def _spec(args: argparse.Namespace):
    from hetserve.disagg.cluster_spec import ClusterSpec
    from hetserve.server.validation import is_json_type

    options = {
        "model": args.model, "prefill": args.prefill, "decode": args.decode, "both": args.both,
        "store": args.store, "store_dram": args.store_dram, "port": args.port,
        "policy": args.policy, "admission": args.admission, "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tbt_ms": args.slo_tbt_ms, "handoff_path": args.handoff_path,
        "instance_args": _instance_args(args.instance_args, "--instance-args"),
        "log_dir": args.log_dir,
        "log_requests": args.log_requests, "restart": not args.no_restart, "host": args.host,
        "api_key": args.api_key, "launcher": args.launcher, "ray_address": args.ray_address,
        "ray_resources": _resources(args.ray_resources),
        "role_args": _role_args(dict(_split_role_args(flag) for flag in args.role_args)),
    }  # fmt: skip
    if args.config is not None:
        import yaml

        try:
            data = yaml.safe_load(Path(args.config).read_text()) or {}
        except OSError as exc:
            raise InvalidInputError(f"--config {args.config}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            line = getattr(getattr(exc, "problem_mark", None), "line", None)
            where = f" at line {line + 1}" if line is not None else ""
            raise InvalidInputError(f"--config {args.config}: not valid YAML{where}") from None
        if not isinstance(data, dict):
            raise InvalidInputError(f"--config {args.config}: expected a mapping of options")
        unknown = set(data) - set(options)
        if unknown:
            raise InvalidInputError(f"--config {args.config}: unknown keys {sorted(unknown)}")
        for key, value in data.items():  # each as its flag takes it (a count is an integer)
            kinds = _CONFIG_KINDS.get(key, (str,))
            if value is not None and not is_json_type(value, kinds):
                raise InvalidInputError(
                    f"--config {args.config}: {key}: {value!r} should be {kinds[-1].__name__}"
                )
        if "instance_args" in data:
            data["instance_args"] = _instance_args(str(data["instance_args"]), "instance_args")
        if "role_args" in data:
            data["role_args"] = _role_args(data["role_args"])
        options.update(data)
    try:
        return ClusterSpec(**options)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"cluster: {exc}") from None


def _check(spec) -> None:
    """The Conductor's options, before any instance starts (it starts last)."""
    from hetserve.disagg.policy import ADMISSIONS, POLICIES
    from hetserve.entrypoints.serve import check_port, is_loopback

    if spec.policy not in POLICIES:
        raise InvalidInputError(f"policy {spec.policy!r}: choose from {', '.join(POLICIES)}")
    if spec.admission not in ADMISSIONS:
        raise InvalidInputError(
            f"admission {spec.admission!r}: choose from {', '.join(ADMISSIONS)}"
        )
    for ms in (spec.slo_ttft_ms, spec.slo_tbt_ms):
        if ms is not None and not ms > 0:
            raise InvalidInputError("SLOs must be positive milliseconds")
    if spec.admission == "predictive" and spec.slo_ttft_ms is None and spec.slo_tbt_ms is None:
        raise InvalidInputError("admission predictive needs --slo-ttft-ms or --slo-tbt-ms")
    check_port(spec.host, spec.port)  # the Conductor runs here with either launcher
    if spec.launcher == "local" and not is_loopback(spec.host) and not spec.api_key:
        raise InvalidInputError(
            f"refusing to bind {spec.host} without an API key; pass --api-key (or set "
            "HETSERVE_API_KEY), or bind 127.0.0.1"
        )


def _key(spec):
    """With Ray every part listens beyond loopback: the cluster's key, made up if not given
    (written where the user finds it, readable by them only)."""
    import dataclasses
    import os
    import secrets

    if spec.launcher != "ray" or spec.api_key:
        return spec
    path = Path(spec.log_dir) / "api-key"
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    print(f"clients send the key in {path} (Authorization: Bearer KEY)", flush=True)
    return dataclasses.replace(spec, api_key=key)


def _up(args: argparse.Namespace) -> int:
    import dataclasses

    import httpx

    from hetserve import envs
    from hetserve.disagg.launch import (
        LaunchCancelled,
        LaunchError,
        LocalLauncher,
        status_table,
    )

    spec = _spec(args)
    spec = dataclasses.replace(spec, api_key=spec.api_key or envs.api_key())
    _check(spec)
    spec = _key(spec)
    if spec.launcher == "ray":
        from hetserve.disagg.ray_launch import RayLauncher, import_ray

        import_ray()  # missing: the one-line error, before anything starts
        launcher: LocalLauncher | RayLauncher = RayLauncher(spec.ray_address)
    else:
        launcher = LocalLauncher()
    stop = threading.Event()

    def stopped(*_: object) -> None:
        stop.set()
        launcher.cancel.set()  # a start under way stops at once, with what it started

    def on_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, stopped)

    on_signals()
    try:
        running = launcher.start(spec)
    except LaunchCancelled as exc:
        print(f"{exc}; the parts started are stopped", flush=True)
        return 130
    except LaunchError as exc:
        raise InvalidInputError(f"the cluster did not start: {exc}") from None
    on_signals()  # Ray's driver took SIGTERM over as it connected (it exits with 15)
    try:
        print(f"cluster ready: {running.endpoint}", flush=True)
        key = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        base = running.endpoint.removesuffix("/v1")
        health = httpx.get(base + "/health", headers=key, timeout=5).json()
        for part in running.parts:
            print(f"  {part.name:<16} on {part.address}", flush=True)
        print(status_table(health.get("instances", [])), flush=True)
        print(f"logs in {spec.log_dir}/; Ctrl-C stops everything", flush=True)
        while not stop.wait(1.0):
            for line in launcher.supervise() if spec.restart else []:
                print(line, flush=True)
    finally:
        print("stopping the cluster", flush=True)
        launcher.stop()
    return 0
