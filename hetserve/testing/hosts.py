"""Several "hosts" on one machine for tests: network namespaces on a bridge, each with its own
address and hostname (so no two of them take each other for the same host and share memory).

Who calls it: tests that need a second machine (the Ray launcher's two-node cluster). `Hosts(n)`
makes namespaces `<tag>-1` .. `<tag>-n` at 10.X.Y.1 .. n, reachable from this namespace (the
bridge holds .254); `command(i, argv)` is `argv` run inside host i; `close()` kills whatever
still runs in them and removes them.

Failure contract: `Hosts.unavailable()` says why they cannot be made here (not root, no `ip` or
`unshare`, or the kernel refuses), for the test to skip with; a setup that fails half way
removes what it made and raises `RuntimeError` with the command's message.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess


def _run(*argv: str) -> None:
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip()}")


class Hosts:
    def __init__(self, n: int, tag: str | None = None) -> None:
        pid = os.getpid()
        self.tag = tag or f"hs{pid % 100000}"
        self.subnet = f"10.{100 + pid % 100}.{pid // 100 % 250}"
        self.bridge = f"{self.tag}br"
        self.names = [f"{self.tag}-{i}" for i in range(1, n + 1)]
        self.addresses = [f"{self.subnet}.{i}" for i in range(1, n + 1)]
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for i, (ns, addr) in enumerate(zip(self.names, self.addresses, strict=True), 1):
                veth = f"{self.tag}v{i}"
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                     "netns", ns)  # fmt: skip
                _run("ip", "link", "set", veth, "master", self.bridge)
                _run("ip", "link", "set", veth, "up")
                _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "network namespaces need root"
        for tool in ("ip", "unshare", "hostname"):
            if shutil.which(tool) is None:
                return f"no `{tool}` command here"
        probe = f"hsprobe{os.getpid() % 100000}"
        out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if out.returncode:
            return f"cannot make a network namespace: {out.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return None

    def command(self, i: int, argv: list[str]) -> list[str]:
        """`argv` run on host i (1-based): in its network namespace, with its own hostname."""
        ns = self.names[i - 1]
        script = f'hostname {ns} && exec "$@"'
        return ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", script, "sh", *argv]

    def pids(self, i: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.names[i - 1]], capture_output=True,
                             text=True)  # fmt: skip
        return [int(p) for p in out.stdout.split()]

    def close(self) -> None:
        for i, ns in enumerate(self.names, 1):
            for pid in self.pids(i):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
