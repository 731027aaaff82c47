"""Starting a cluster's parts on the nodes of a Ray cluster (`cluster up --launcher ray`).

Who calls it: `hetserve cluster up --launcher ray` (entrypoints/cluster.py), through the
interface `LocalLauncher` has (`start`, `supervise`, `stop`, disagg/launch.py). The parts and
their commands are the same (`cluster_spec.plan`); what differs is where they run:

- each part is a `PartRunner` actor that starts the part's process on its node, with the
  node's own Python (hetserve must be installed on every node, the model at the same path),
  and answers for it (poll, signals, its log's tail);
- the Conductor and the store master run on this machine's node (the driver's), each instance
  where Ray's SPREAD strategy puts it among the nodes with the resources its role asks
  (`ClusterSpec.ray_resources`, e.g. a custom resource each big box declares at `ray start`),
  and with `--store pool` a store node on every node that holds an instance, giving its DRAM
  to the pool;
- every part listens on its node's address, so every part gets the cluster's key: the API
  key (instances and Conductor), the hand-off token, the store token and the KV events' token
  are one secret (`spec.api_key`, else one made here: `RayLauncher.api_key`).

Failure contract: Ray missing is an `InvalidInputError` naming the extra to install; an
instance that no node can hold within `placement_timeout_s` is a `LaunchError` naming what it
asked and what the cluster has; otherwise as `LocalLauncher` (a part that exits or does not
answer while the cluster starts stops everything). Once running, an instance or store node
whose runner is gone (its node lost) is placed again where Ray finds room, and the Conductor
told an instance's new address (`supervise()`).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from hetserve.disagg.cluster_spec import ClusterSpec, Part, plan
from hetserve.disagg.launch import (
    LaunchError,
    PartsLauncher,
    free_port,
    signal_group,
    spawn,
    tail,
)
from hetserve.errors import InvalidInputError

PYTHON = "{python}"  # in a planned command: the Python of the node it runs on
CALL_S = 30.0  # an answer from a runner: it only forks, polls or reads a file


def import_ray() -> Any:
    # Ray's own handler prints a stack dump at every SIGTERM (`cluster up`'s way to stop).
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    try:
        import ray
    except ImportError:
        raise InvalidInputError(
            "--launcher ray needs Ray on every node: pip install 'hetserve[ray]'"
        ) from None
    return ray


class PartRunner:
    """A Ray actor that runs one part's process on the node Ray placed it on."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def where(self) -> tuple[str, str]:
        """This node's Ray ID and address."""
        ray = import_ray()
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self, host: str) -> int:
        return free_port(host)

    def spawn(
        self, cmd: list[str], env: dict[str, str], log: str, append: bool, dirs: list[str]
    ) -> int:
        cmd = [sys.executable if a == PYTHON else a for a in cmd]
        # Ray sets OMP_NUM_THREADS to an actor's CPUs (1 for a runner that asks none): an
        # instance would run its kernels on one thread. Only the launcher's value stands.
        os.environ.pop("OMP_NUM_THREADS", None)
        self.proc = spawn(cmd, env, Path(log), append, dirs)
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait(self, timeout: float | None) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            signal_group(self.proc, sig)

    def tail(self, log: str, lines: int) -> str:
        return tail(log, lines)


class RemoteProc:
    """A part's process on a Ray node, as `subprocess.Popen` answers for a local one. A runner
    that died (its node gone, or killed) reads as a process killed by SIGKILL, `gone`."""

    def __init__(self, ray: Any, actor: Any, pid: int) -> None:
        self.ray, self.actor, self.pid = ray, actor, pid  # its pid on its node
        self.returncode: int | None = None
        self.gone = False

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self.ray.get(self.actor.poll.remote(), timeout=CALL_S)
            except self.ray.exceptions.RayActorError:
                self.returncode, self.gone = -signal.SIGKILL, True
            except self.ray.exceptions.GetTimeoutError:  # a busy node: asked again later
                return None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is not None:
            assert self.returncode is not None
            return self.returncode
        try:
            code = self.ray.get(self.actor.wait.remote(timeout), timeout=(timeout or 0.0) + CALL_S)
        except self.ray.exceptions.RayActorError:
            code, self.gone = -signal.SIGKILL, True
        if code is None:
            raise subprocess.TimeoutExpired("part", timeout or 0.0)
        self.returncode = code
        return int(code)

    def send_signal(self, sig: int) -> None:
        try:
            self.ray.get(self.actor.signal.remote(sig), timeout=CALL_S)
        except self.ray.exceptions.RayActorError:
            self.gone = True


class RayLauncher(PartsLauncher):
    def __init__(
        self,
        address: str | None = None,
        ready_timeout_s: float = 300.0,
        grace_s: float = 10.0,
        placement_timeout_s: float = 120.0,
    ) -> None:
        super().__init__(ready_timeout_s, grace_s)
        self.address, self.placement_timeout_s = address, placement_timeout_s
        self.api_key = self.admin_key = ""
        self.actors: dict[str, Any] = {}  # part name -> its runner
        self.made: list[Any] = []  # every runner, placed or not (stop() ends them)
        self.placing: list[tuple[Part, Any, Any]] = []  # lost instances: part, runner, where
        # Conductor calls still to make: (DELETE or POST, address, URL, role).
        self.untold: list[tuple[str, str, str | None, str]] = []
        self.spec = ClusterSpec()
        self.runner_cls: Any = None
        self._key: dict[str, str] = {}
        self.started_ray = False
        self.ray: Any = None

    def _prepare(self, spec: ClusterSpec) -> list[Part]:
        ray = self.ray = import_ray()
        if not ray.is_initialized():
            _reachable(self.address)
            try:
                # None: a new instance here ("local"), never one a `ray start` left running.
                ray.init(address=self.address or "local", include_dashboard=False,
                         log_to_driver=False,
                         logging_level="WARNING")  # fmt: skip
            except (ConnectionError, RuntimeError, ValueError) as exc:
                where = self.address or "a new local instance"
                raise LaunchError(f"Ray at {where}: {str(exc).splitlines()[0]}") from None
            self.started_ray = True
        self.api_key = spec.api_key or secrets.token_urlsafe(24)
        self.admin_key = secrets.token_urlsafe(24)  # moves instances: this launcher's alone
        spec = _absolute(spec)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        runner = self.runner_cls = ray.remote(PartRunner)
        self.spec = spec
        self._key = {"Authorization": f"Bearer {self.admin_key}"}
        here = ray.get_runtime_context().get_node_id()
        # The instances first: where Ray puts them says where the store nodes go.
        roles = [r for r, n in (("prefill", spec.prefill), ("decode", spec.decode),
                                ("both", spec.both)) for _ in range(n)]  # fmt: skip
        placed = [self._runner(dict(spec.ray_resources.get(r, {}))) for r in roles]
        self.made += placed
        try:
            where = ray.get([a.where.remote() for a in placed], timeout=self.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise LaunchError(
                f"Ray placed no node for every instance in {self.placement_timeout_s:.0f} s: "
                f"they ask {dict(spec.ray_resources) or 'nothing'}; the cluster has "
                f"{ray.cluster_resources()}"
            ) from None
        nodes = list(dict.fromkeys(node for node, _ in where))
        parts = plan(spec, PYTHON, store_nodes=len(nodes))
        env = {"HETSERVE_API_KEY": self.api_key, "HETSERVE_HANDOFF_TOKEN": self.api_key,
               "HETSERVE_STORE_TOKEN": self.api_key}  # fmt: skip
        parts[-1].env["HETSERVE_ADMIN_KEY"] = self.admin_key  # the Conductor's membership
        ips = {node: ip for node, ip in where}
        instances = iter(zip(placed, where, strict=True))
        stores = iter(nodes)
        for part in parts:
            part.env.update(env)
            if part.role:
                actor, (_, ip) = next(instances)
                part.host = ip
                cpus = spec.ray_resources.get(part.role, {}).get("CPU")
                if cpus:  # the CPUs it asked Ray for: its kernels' threads
                    part.env["OMP_NUM_THREADS"] = str(int(cpus))
            else:
                node = next(stores) if part.name.startswith("store-node") else here
                actor = runner.options(
                    num_cpus=0,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                ).remote()
                self.made.append(actor)
                if part.name != "conductor":  # the Conductor binds the user's --host
                    part.host = ips.get(node, ray.util.get_node_ip_address())
            self.actors[part.name] = actor
        return parts

    def _runner(self, needs: dict[str, float]) -> Any:
        """A runner for an instance, placed where Ray finds a node with `needs`."""
        asked = dict(needs)
        cpus, gpus = needs.pop("CPU", 0), needs.pop("GPU", 0)
        try:
            return self.runner_cls.options(
                num_cpus=cpus, num_gpus=gpus, resources=needs, scheduling_strategy="SPREAD"
            ).remote()
        except (ValueError, TypeError) as exc:  # Ray's own rules for resource requests
            raise LaunchError(f"Ray refused the resources {asked}: {exc}") from None

    def _free_port(self, part: Part) -> int:
        port: int = self.ray.get(self.actors[part.name].free_port.remote(part.host),
                                 timeout=CALL_S)  # fmt: skip
        return port

    def _spawn(self, part: Part, append: bool = False) -> None:
        assert part.log is not None
        actor = self.actors[part.name]
        env = {**part.env, "MC_TCP_BIND_ADDRESS": part.host}  # Mooncake's hand-off
        part.started_at = time.monotonic()
        pid = self.ray.get(actor.spawn.remote(part.cmd, env, str(part.log), append, part.dirs),
                           timeout=CALL_S)  # fmt: skip
        part.proc = RemoteProc(self.ray, actor, pid)

    def _signal(self, part: Part, sig: int) -> None:
        assert part.proc is not None
        part.proc.send_signal(sig)

    def _tail(self, part: Part, lines: int = 5) -> str:
        try:
            text: str = self.ray.get(
                self.actors[part.name].tail.remote(str(part.log), lines), timeout=CALL_S
            )
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
            return ""
        return text

    def supervise(self, now: float | None = None) -> list[str]:
        """As `LocalLauncher`'s, and: an instance or store node whose runner is gone (its node
        lost, or the runner killed) is placed again wherever Ray finds room and started there
        on a new address; for an instance the Conductor is told (the old address removed, the
        new one joins once it answers). The store master and the Conductor share the driver's
        node: theirs gone is said once and left down."""
        said: list[str] = []
        if self.untold and not self._retell():
            said.append("the Conductor was told where the moved instances are")
        for part in list(self.running.parts):
            proc = part.proc
            if not (isinstance(proc, RemoteProc) and proc.poll() is not None and proc.gone):
                continue
            self.running.parts.remove(part)
            lost = f"{part.name}: its Ray runner on {part.host} is gone"
            if not part.role and not part.name.startswith("store-node"):
                said.append(f"{lost}; not started again")
                continue
            said.append(f"{lost}; placing it again" + self._tell("DELETE", part))
            self._place_again(part)
        for entry in list(self.placing):
            part, actor, ref = entry
            ready, _ = self.ray.wait([ref], timeout=0)
            if not ready:
                continue
            self.placing.remove(entry)
            try:
                _, part.host = self.ray.get(ref)
                self.actors[part.name] = actor
                part.port, part.restart_at, part.backoff_s = 0, None, 0.0
                part.restarts += 1
                self._launch(part, append=True)  # a free port on its new node
            except self.ray.exceptions.RayError as exc:  # that node went too: place it again
                said.append(f"{part.name}: could not start on its new node ({exc}); placing "
                            "it again")  # fmt: skip
                self._place_again(part)
                continue
            self.running.parts.append(part)
            said.append(f"{part.name} started again on {part.address} (restart "
                        f"{part.restarts}, log {part.log})" + self._tell("POST", part))  # fmt: skip
        return said + super().supervise(now)

    def _place_again(self, part: Part) -> None:
        """A runner for `part` where Ray finds room (an instance: with its role's resources),
        started by `supervise` once placed."""
        actor = self._runner(dict(self.spec.ray_resources.get(part.role, {})))
        self.made.append(actor)
        self.placing.append((part, actor, actor.where.remote()))

    def _tell(self, method: str, part: Part) -> str:
        """Tell the Conductor that instance `part` left (DELETE) or joins (POST) at its
        address now; what went wrong, if anything, for the line said ("" for other parts).
        A call that fails is tried again at every `supervise` until it goes through."""
        if not part.role:
            return ""
        self.untold.append((method, part.address, part.url, part.role))
        return self._retell()

    def _retell(self) -> str:
        conductor = next((p for p in self.running.parts if p.name == "conductor"), None)
        if conductor is None or conductor.url is None:
            return "; no Conductor to tell (yet)"
        base = f"{conductor.url}/internal/instances"
        while self.untold:
            method, address, url, role = self.untold[0]
            try:
                if method == "DELETE":
                    r = httpx.delete(f"{base}/{address}", headers=self._key, timeout=10)
                    ok = r.status_code in (200, 404)  # 404: not in it (it was joining)
                else:
                    r = httpx.post(base, json={"url": url, "role": role}, headers=self._key,
                                   timeout=10)  # fmt: skip
                    ok = r.status_code in (202, 409)  # 409: in it already
            except httpx.HTTPError as exc:
                return f"; the Conductor was not told yet ({exc}); trying again"
            if not ok:
                return f"; the Conductor answered {r.status_code}: {r.text[:200]}; trying again"
            self.untold.pop(0)
        return ""

    def stop(self) -> None:
        super().stop()
        if self.ray is None:
            return
        for actor in self.made:
            try:
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone with its node
                pass
        self.actors.clear()
        self.made.clear()
        self.placing.clear()
        if self.started_ray:
            self.ray.shutdown()
            self.started_ray = False


def _absolute(spec: ClusterSpec) -> ClusterSpec:
    """Paths as every node reads them: absolute (a relative one was this directory's)."""
    model = spec.model
    if model is not None and Path(model).exists():
        model = str(Path(model).resolve())
    logs = None if spec.log_requests is None else str(Path(spec.log_requests).resolve())
    return dataclasses.replace(
        spec, model=model, log_dir=str(Path(spec.log_dir).resolve()), log_requests=logs
    )


def _reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """A Ray cluster named HOST:PORT must answer there: Ray's own client retries for minutes,
    printing its raw log lines, where nothing listens. ("auto" and None are Ray's to resolve.)"""
    import socket

    if not address or address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise LaunchError(f"--ray-address wants HOST:PORT (or auto), got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise LaunchError(
            f"no Ray cluster answers at {address} ({exc.strerror or exc}); check --ray-address "
            "(the head's `ray start --head --port` address)"
        ) from None
