"""Starting a cluster: the pool store, prefill/decode instances and the Conductor, as processes.

Who calls it: `hetserve cluster up` (entrypoints/cluster.py). A `ClusterSpec` says what to run
and `cluster_spec.plan` turns it into parts in dependency order (store master, store nodes,
instances, Conductor), each one's command built as it starts. A launcher runs them:
`LocalLauncher` starts every part as a child process of this one on 127.0.0.1; `RayLauncher`
(disagg/ray_launch.py) starts each on a node of a Ray cluster, beyond loopback, with a key.
Both wait for each part to answer, and stop them all, newest first, on `stop()`: with SIGTERM,
then SIGKILL after a grace period. Children also get the kernel's parent-death signal, so even
a launcher killed with SIGKILL leaves no orphans.

Once running, `supervise()` (called by `cluster up` about once a second) starts again each part
that exited, with the same command, port and log, after a back-off that doubles while it keeps
exiting soon after its start (1 s up to a minute, as Kubernetes does with a crash loop). A
restarted instance comes back at the same address: the Conductor's health checks see it (and
its KV index resyncs), and a Conductor started again while an instance is down adds it when it
answers.

Failure contract: a part that exits or does not answer in `ready_timeout_s` while the cluster
starts stops everything already started and raises `LaunchError` naming it and the tail of its
log. Later exits are `supervise()`'s lines (the part, its exit status, its log's last line),
never an exception.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

from hetserve.disagg.cluster_spec import ClusterSpec, Part, bracket, plan
from hetserve.errors import HetserveError

PR_SET_PDEATHSIG = 1


class LaunchError(HetserveError):
    """A part of the cluster did not start."""


class LaunchCancelled(LaunchError):
    """The start was called off (`PartsLauncher.cancel`, set by a signal) before it ended."""


@dataclass
class Running:
    parts: list[Part] = field(default_factory=list)
    endpoint: str = ""


class Launcher(Protocol):
    def start(self, spec: ClusterSpec) -> Running: ...

    def supervise(self) -> list[str]: ...

    def stop(self) -> None: ...


# Starts of a part whose free port was taken meanwhile, each on a new one.
PORT_TRIES = 3
# A part that exited is started again after a back-off: 1 s, doubled at each exit within
# STABLE_S of its start, at most MAX_BACKOFF_S; a part that ran STABLE_S starts over at 1 s.
FIRST_BACKOFF_S, MAX_BACKOFF_S, STABLE_S = 1.0, 60.0, 60.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def reach(host: str) -> str:
    """The address to call a server bound to `host` at, from its own machine."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: stop() still stops them
        pass


class PartsLauncher:
    """What both launchers share: starting parts in order (a part whose free port was taken
    meanwhile gets another), waiting for each to answer, restarting the ones that exit, and
    stopping them all. Subclasses say where a part runs: `_free_port`, `_spawn`, `_signal`,
    `_tail`."""

    def __init__(self, ready_timeout_s: float = 300.0, grace_s: float = 10.0) -> None:
        self.ready_timeout_s, self.grace_s = ready_timeout_s, grace_s
        self.running = Running()
        self.cancel = threading.Event()  # set (by a signal): a start stops at the next check

    def start(self, spec: ClusterSpec) -> Running:
        logs = Path(spec.log_dir).resolve()
        logs.mkdir(parents=True, exist_ok=True)
        try:
            for part in self._prepare(spec):
                if self.cancel.is_set():
                    raise LaunchCancelled(f"stopped before {part.name} started")
                part.log = logs / f"{part.name}.log"
                self._start_part(part)
        except BaseException:
            self.stop()
            raise
        self.running.endpoint = f"http://{bracket(reach(spec.host))}:{spec.port}/v1"
        return self.running

    def _prepare(self, spec: ClusterSpec) -> list[Part]:
        raise NotImplementedError

    def _start_part(self, part: Part) -> None:
        """Spawn `part` and wait until it answers. A free port is picked just before, and
        something started meanwhile may take it (an ephemeral port of an outgoing connection
        or of a listener on port 0: seen once in CI, "cannot listen on 127.0.0.1:37163 (in
        use)"); then it gets another, which the parts built after it see."""
        for attempt in range(PORT_TRIES):
            self._launch(part)
            self.running.parts.append(part)
            try:
                self._wait(part)
                return
            except LaunchError:
                if not part.chosen or attempt + 1 == PORT_TRIES or "in use" not in self._tail(part):
                    raise
            self.running.parts.remove(part)  # it exited
            part.port = 0

    def supervise(self, now: float | None = None) -> list[str]:
        """Start again the parts that exited, each after its back-off; what happened, a line
        per event, for the caller to print."""
        now = time.monotonic() if now is None else now
        said: list[str] = []
        for part in self.running.parts:
            if part.proc is None or part.proc.poll() is None:
                continue
            code = part.proc.returncode
            assert code is not None
            if part.restart_at is None:
                stable = now - part.started_at >= STABLE_S
                part.backoff_s = (
                    FIRST_BACKOFF_S
                    if stable or not part.backoff_s
                    else min(MAX_BACKOFF_S, 2 * part.backoff_s)
                )
                part.restart_at = now + part.backoff_s
                # Its last words where it exited itself (a killed part's are whatever it was
                # doing then).
                last = self._tail(part, 1) if code > 0 else ""
                said.append(
                    f"{part.name} {_exit_status(code)}; starting it again in "
                    f"{part.backoff_s:.0f} s" + (f" (its log: {last})" if last else "")
                )
            elif now >= part.restart_at:
                part.restart_at = None
                part.restarts += 1
                self._launch(part, append=True)  # a Conductor: the instances where they are now
                said.append(f"{part.name} started again (restart {part.restarts}, log {part.log})")
        return said

    def _launch(self, part: Part, append: bool = False) -> None:
        """Spawn `part` where it is placed: on a free port if it has none, its command built
        now (the parts it names, where they are now)."""
        if part.chosen and not part.port:
            part.port = self._free_port(part)
        if part.build is not None:
            part.cmd = part.build(part)
        if part.http:
            part.url = f"http://{bracket(reach(part.host))}:{part.port}"
        self._spawn(part, append)

    def _wait(self, part: Part) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            assert part.proc is not None
            if self.cancel.is_set():
                raise LaunchCancelled(f"stopped while {part.name} was starting")
            if part.proc.poll() is not None:
                raise LaunchError(
                    f"{part.name} exited ({part.proc.returncode}): {self._tail(part)}"
                )
            if _answers(part):
                return
            time.sleep(0.2)
        raise LaunchError(f"{part.name} did not answer in {self.ready_timeout_s:.0f} s")

    def stop(self) -> None:
        """Every part, newest first: SIGTERM, then SIGKILL after the grace period."""
        for part in reversed(self.running.parts):
            if part.proc is not None and part.proc.poll() is None:
                self._signal(part, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for part in reversed(self.running.parts):
            if part.proc is None:
                continue
            try:
                part.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(part, signal.SIGKILL)
                part.proc.wait(5)
        self.running.parts.clear()

    def _free_port(self, part: Part) -> int:
        raise NotImplementedError

    def _spawn(self, part: Part, append: bool = False) -> None:
        raise NotImplementedError

    def _signal(self, part: Part, sig: int) -> None:
        raise NotImplementedError

    def _tail(self, part: Part, lines: int = 5) -> str:
        return tail(part.log, lines)


class LocalLauncher(PartsLauncher):
    """Every part a child process of this one, on 127.0.0.1 (the Conductor on `spec.host`)."""

    def _prepare(self, spec: ClusterSpec) -> list[Part]:
        parts = plan(spec, sys.executable)
        for part in parts:
            part.env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # Mooncake: loopback
        if spec.api_key:  # the clients': the instances, on loopback, ask for none
            parts[-1].env["HETSERVE_API_KEY"] = spec.api_key
        return parts

    def _free_port(self, part: Part) -> int:
        return free_port(part.host)

    def _spawn(self, part: Part, append: bool = False) -> None:
        assert part.log is not None
        part.started_at = time.monotonic()
        part.proc = spawn(part.cmd, part.env, part.log, append, part.dirs)

    def _signal(self, part: Part, sig: int) -> None:
        assert isinstance(part.proc, subprocess.Popen)
        signal_group(part.proc, sig)


def spawn(
    cmd: list[str], env: Mapping[str, str], log: Path, append: bool, dirs: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """Start `cmd` in its own session, writing to `log` (appended to, with a line saying so,
    on a restart), dying with this process; `dirs` made first."""
    for d in [str(log.parent), *dirs]:
        Path(d).mkdir(parents=True, exist_ok=True)
    if append:
        with open(log, "ab") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} started again\n".encode())
    with open(log, "ab" if append else "wb") as f:
        return subprocess.Popen(
            cmd,
            env={**os.environ, **env},
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a terminal's Ctrl-C reaches the launcher only
            preexec_fn=die_with_parent,
        )


def signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # its own session: the part and anything it started
    except ProcessLookupError:
        pass


def _answers(part: Part) -> bool:
    if part.url is None:
        try:
            with socket.create_connection((reach(part.host), part.port), timeout=0.5):
                return True
        except OSError:
            return False
    try:
        return httpx.get(part.url + "/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def tail(log: Path | str | None, lines: int = 5) -> str:
    """The last `lines` lines of a log, joined by " | " ("" if it is not there)."""
    if log is None or not Path(log).exists():
        return ""
    text = Path(log).read_text(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:])


def status_table(rows: Sequence[dict[str, object]]) -> str:
    cols = ["name", "role", "healthy", "queued_requests", "running_decodes", "free_blocks"]
    out = ["  ".join(f"{c:>16}" for c in cols)]
    for r in rows:
        out.append("  ".join(f"{str(r.get(c, '-')):>16}" for c in cols))
    return "\n".join(out)
