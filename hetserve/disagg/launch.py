"""Starting a cluster: the pool store, prefill/decode instances and the Conductor, as processes.

Who calls it: `hetserve cluster up` (entrypoints/cluster.py). A `ClusterSpec` says what to run;
a `Launcher` runs it. `LocalLauncher` starts every part as a child process on 127.0.0.1, in
dependency order (store master, store node, instances, Conductor), waits for each to answer,
and stops them all, newest first, on `stop()`: with SIGTERM, then SIGKILL after a grace period.
Children also get the kernel's parent-death signal, so even a launcher killed with SIGKILL
leaves no orphans. (A Ray launcher, for deployment past one machine, implements the same
interface.)

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
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

from hetserve.errors import HetserveError

PR_SET_PDEATHSIG = 1


class LaunchError(HetserveError):
    """A part of the cluster did not start."""


@dataclass(frozen=True)
class ClusterSpec:
    model: str | None = None  # None: the demo model
    prefill: int = 1
    decode: int = 1
    both: int = 0
    store: str = "none"  # "none" or "pool"
    store_dram: str = "1G"
    port: int = 8000  # the Conductor's; the others take free ports
    policy: str = "kvcentric"
    admission: str = "none"
    slo_ttft_ms: float | None = None
    slo_tbt_ms: float | None = None
    handoff_path: str = "direct"
    instance_args: tuple[str, ...] = ()  # extra engine options for every instance
    log_requests: str | None = None  # a directory: each part's request log (hetserve sim's)
    log_dir: str = "hetserve-cluster-logs"
    restart: bool = True  # start a part that exits again (`LocalLauncher.supervise`)

    def __post_init__(self) -> None:
        if self.store not in ("none", "pool"):
            raise ValueError(f"store must be none or pool, got {self.store!r}")
        if min(self.prefill, self.decode, self.both) < 0:
            raise ValueError("instance counts must be >= 0")
        if not (self.prefill and self.decode) and not self.both:
            raise ValueError("give prefill and decode instances, or colocated (both) ones")
        if self.handoff_path == "store" and self.store == "none":
            raise ValueError("--handoff-path store needs --store pool")


@dataclass
class Part:
    name: str
    cmd: list[str]
    url: str | None = None  # answered /health when ready; else a TCP port
    port: int = 0
    chosen: bool = True  # its port was a free one picked here (not the user's --port)
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    started_at: float = 0.0  # time.monotonic() of its last start
    restarts: int = 0
    backoff_s: float = 0.0  # the wait before its last restart (0 before any)
    restart_at: float | None = None  # it exited: when it starts again


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: stop() still stops them
        pass


class LocalLauncher:
    def __init__(self, ready_timeout_s: float = 300.0, grace_s: float = 10.0) -> None:
        self.ready_timeout_s, self.grace_s = ready_timeout_s, grace_s
        self.running = Running()

    def start(self, spec: ClusterSpec) -> Running:
        logs = Path(spec.log_dir)
        logs.mkdir(parents=True, exist_ok=True)
        try:
            parts = self._plan(spec)
            for i, part in enumerate(parts):
                part.log = logs / f"{part.name}.log"
                self._start_part(part, parts[i + 1 :])
        except BaseException:
            self.stop()
            raise
        self.running.endpoint = f"http://127.0.0.1:{spec.port}/v1"
        return self.running

    def _plan(self, spec: ClusterSpec) -> list[Part]:
        py = [sys.executable, "-m"]
        parts: list[Part] = []
        store_args: list[str] = []
        if spec.store == "pool":
            mport, nport = free_port(), free_port()
            parts.append(Part("store-master", [*py, "hetserve.entrypoints.store", "master",
                                               "--port", str(mport)], port=mport))  # fmt: skip
            parts.append(Part("store-node", [*py, "hetserve.entrypoints.store", "node",
                                             "--master", f"127.0.0.1:{mport}", "--dram",
                                             spec.store_dram, "--port", str(nport)],
                              port=nport))  # fmt: skip
            store_args = ["--kv-store", f"pool://127.0.0.1:{mport}"]
        model = ["--model", spec.model] if spec.model else []
        if spec.handoff_path == "mooncake":
            store_args = [*store_args, "--handoff-mooncake"]
        urls: dict[str, list[str]] = {"prefill": [], "decode": [], "both": []}
        for role, n in (("prefill", spec.prefill), ("decode", spec.decode), ("both", spec.both)):
            for i in range(n):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                # KV events on free ports (kv_info names them): the Conductor's KV index.
                cmd = [*py, "hetserve.cli", "serve", *model, "--role", role, "--port", str(port),
                       "--kv-events", "tcp://127.0.0.1:0", *store_args,
                       *spec.instance_args]  # fmt: skip
                if spec.log_requests is not None:
                    cmd += ["--log-requests", str(Path(spec.log_requests) / f"{role}-{i}.jsonl")]
                parts.append(Part(f"{role}-{i}", cmd, url=url, port=port))
                urls[role].append(url)
        cond = [*py, "hetserve.cli", "conductor", *model, "--port", str(spec.port),
                "--policy", spec.policy, "--admission", spec.admission,
                "--handoff-path", spec.handoff_path]  # fmt: skip
        for role, flag in (("prefill", "--prefill"), ("decode", "--decode"), ("both", "--both")):
            if urls[role]:
                cond += [flag, *urls[role]]
        if spec.slo_ttft_ms is not None:
            cond += ["--slo-ttft-ms", str(spec.slo_ttft_ms)]
        if spec.slo_tbt_ms is not None:
            cond += ["--slo-tbt-ms", str(spec.slo_tbt_ms)]
        if spec.log_requests is not None:
            Path(spec.log_requests).mkdir(parents=True, exist_ok=True)
            cond += ["--log-requests", str(Path(spec.log_requests) / "conductor.jsonl")]
        parts.append(
            Part("conductor", cond, url=f"http://127.0.0.1:{spec.port}", port=spec.port,
                 chosen=False)
        )  # fmt: skip
        return parts

    def _start_part(self, part: Part, later: list[Part]) -> None:
        """Spawn `part` and wait until it answers. Its free port was picked when the cluster
        was planned, and a part started since may have taken it (an ephemeral port of an
        outgoing connection or of a listener on port 0: seen once in CI, "cannot listen on
        127.0.0.1:37163 (in use)"); then it gets another, which the later parts are told."""
        for attempt in range(PORT_TRIES):
            self._spawn(part)
            self.running.parts.append(part)
            try:
                self._wait(part)
                return
            except LaunchError:
                if not part.chosen or attempt + 1 == PORT_TRIES or "in use" not in _tail(part):
                    raise
            self.running.parts.remove(part)  # it exited
            _repoint(part, later, free_port())

    def supervise(self, now: float | None = None) -> list[str]:
        """Start again the parts that exited, each after its back-off; what happened, a line
        per event, for the caller to print."""
        now = time.monotonic() if now is None else now
        said: list[str] = []
        for part in self.running.parts:
            if part.proc is None or part.proc.poll() is None:
                continue
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
                last = _tail(part, 1) if part.proc.returncode > 0 else ""
                said.append(
                    f"{part.name} {_exit_status(part.proc.returncode)}; starting it again in "
                    f"{part.backoff_s:.0f} s" + (f" (its log: {last})" if last else "")
                )
            elif now >= part.restart_at:
                part.restart_at = None
                part.restarts += 1
                self._spawn(part, append=True)
                said.append(f"{part.name} started again (restart {part.restarts}, log {part.log})")
        return said

    def _spawn(self, part: Part, append: bool = False) -> None:
        assert part.log is not None
        part.started_at = time.monotonic()
        if append:
            with open(part.log, "ab") as log:
                log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} started again\n".encode())
        with open(part.log, "ab" if append else "wb") as log:
            part.proc = subprocess.Popen(
                part.cmd,
                env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"},  # Mooncake: loopback
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's Ctrl-C reaches the launcher only
                preexec_fn=_die_with_parent,
            )

    def _wait(self, part: Part) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            assert part.proc is not None
            if part.proc.poll() is not None:
                raise LaunchError(f"{part.name} exited ({part.proc.returncode}): {_tail(part)}")
            if _answers(part):
                return
            time.sleep(0.2)
        raise LaunchError(f"{part.name} did not answer in {self.ready_timeout_s:.0f} s")

    def stop(self) -> None:
        """Every part, newest first: SIGTERM, then SIGKILL after the grace period."""
        for part in reversed(self.running.parts):
            if part.proc is not None and part.proc.poll() is None:
                _signal(part.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for part in reversed(self.running.parts):
            if part.proc is None:
                continue
            try:
                part.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(part.proc, signal.SIGKILL)
                part.proc.wait(5)
        self.running.parts.clear()


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # its own session: the part and anything it started
    except ProcessLookupError:
        pass


def _repoint(part: Part, later: list[Part], port: int) -> None:
    """Move `part` to `port`: its own --port and URL, and every later part's address of it."""
    old, new = f"127.0.0.1:{part.port}", f"127.0.0.1:{port}"
    part.cmd = [str(port) if a == str(part.port) else a.replace(old, new) for a in part.cmd]
    if part.url is not None:
        part.url = part.url.replace(old, new)
    for other in later:
        other.cmd = [a.replace(old, new) for a in other.cmd]
    part.port = port


def _answers(part: Part) -> bool:
    if part.url is None:
        try:
            with socket.create_connection(("127.0.0.1", part.port), timeout=0.5):
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


def _tail(part: Part, lines: int = 5) -> str:
    if part.log is None or not part.log.exists():
        return ""
    text = part.log.read_text(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:])


def status_table(rows: Sequence[dict[str, object]]) -> str:
    cols = ["name", "role", "healthy", "queued_requests", "running_decodes", "free_blocks"]
    out = ["  ".join(f"{c:>16}" for c in cols)]
    for r in rows:
        out.append("  ".join(f"{str(r.get(c, '-')):>16}" for c in cols))
    return "\n".join(out)
