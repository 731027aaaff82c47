"""The local launcher starts a part whose planned free port was taken meanwhile on another one,
and the parts started after it are told the new address (seen once in CI: an instance exited
with "cannot listen on 127.0.0.1:37163 (in use)" because a part started before it held that
ephemeral port)."""

import signal
import socket
import sys
import time

import pytest

from hetserve.disagg.cluster_spec import ClusterSpec, Part, plan
from hetserve.disagg.launch import LaunchError, LocalLauncher, free_port

# Listens on argv[1]'s port (exit 2 naming it "in use" when taken, as `hetserve serve` does);
# with argv[2], first connects to that address (a later part that needs an earlier one).
SERVER = """
import socket, sys, time
if len(sys.argv) > 2:
    host, port = sys.argv[2].split(":")
    socket.create_connection((host, int(port)), timeout=5).close()
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    print(f"error: cannot listen on 127.0.0.1:{sys.argv[1]} (in use)", flush=True)
    sys.exit(2)
s.listen()
while True:
    time.sleep(1)
"""


def test_a_taken_port_is_replaced_and_later_parts_follow(tmp_path, monkeypatch):
    taken = socket.socket()  # bound, not listening: the part cannot bind, nothing answers
    taken.bind(("127.0.0.1", 0))
    old = taken.getsockname()[1]
    first = Part("first", build=lambda p: [sys.executable, "-c", SERVER, str(p.port)])
    later = Part("later", build=lambda p: [sys.executable, "-c", SERVER, str(p.port),
                                           first.address])  # fmt: skip
    launcher = LocalLauncher(ready_timeout_s=30, grace_s=2)
    picked = []  # the first free port picked is taken before the part binds it

    def pick(self, part):
        picked.append(old if not picked else free_port())
        return picked[-1]

    monkeypatch.setattr(LocalLauncher, "_free_port", pick)
    try:
        for part in (first, later):
            part.log = tmp_path / f"{part.name}.log"
        launcher._start_part(first)
        assert picked[0] == old and first.port == picked[1] != old
        assert first.cmd[-1] == str(first.port)
        launcher._start_part(later)  # it reaches the first part where it is now
        assert later.cmd[-1] == f"127.0.0.1:{first.port}"
        assert [p.name for p in launcher.running.parts] == ["first", "later"]
    finally:
        launcher.stop()
        taken.close()


def test_a_port_the_user_gave_is_not_moved(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    conductor = Part("conductor", [sys.executable, "-c", SERVER, str(port)], port=port,
                     chosen=False)  # fmt: skip
    conductor.log = tmp_path / "conductor.log"
    launcher = LocalLauncher(ready_timeout_s=30, grace_s=2)
    try:
        with pytest.raises(LaunchError, match="in use"):
            launcher._start_part(conductor)
        assert conductor.port == port
    finally:
        launcher.stop()
        taken.close()


def test_a_part_that_exits_starts_again_after_a_doubling_back_off(tmp_path):
    """`cluster up` left a crashed instance down for good; now `supervise` starts it again
    (same command, same log, appended), waiting 1 s, 2 s, ... while it keeps exiting at once,
    and 1 s again after a run of a minute."""
    crash = Part("decode-0", [sys.executable, "-c", "print('boom', flush=True); exit(3)"])
    crash.log = tmp_path / "decode-0.log"
    launcher = LocalLauncher(ready_timeout_s=30, grace_s=2)
    try:
        launcher._spawn(crash)
        launcher.running.parts.append(crash)
        crash.proc.wait(30)
        t = time.monotonic()
        assert launcher.supervise(t) == [
            "decode-0 exited with status 3; starting it again in 1 s (its log: boom)"
        ]
        assert launcher.supervise(t + 0.5) == []  # its back-off is not over
        said = launcher.supervise(t + 1.0)
        assert said == [f"decode-0 started again (restart 1, log {crash.log})"]
        crash.proc.wait(30)
        assert "starting it again in 2 s" in launcher.supervise(time.monotonic())[0]
        assert crash.log.read_text().count("boom") == 2  # one log, appended
        launcher.supervise(crash.restart_at)
        crash.proc.wait(30)
        assert "again in 4 s" in launcher.supervise(crash.started_at + 10)[0]
        launcher.supervise(crash.restart_at)
        crash.proc.wait(30)
        assert "again in 1 s" in launcher.supervise(crash.started_at + 61)[0]  # it ran a while
        sleeper = Part("conductor", [sys.executable, "-c", "import time; time.sleep(60)"])
        sleeper.log = tmp_path / "conductor.log"
        launcher._spawn(sleeper)
        launcher.running.parts.append(sleeper)
        sleeper.proc.send_signal(signal.SIGKILL)
        sleeper.proc.wait(30)
        said = launcher.supervise(time.monotonic())
        assert said == ["conductor was killed by SIGKILL; starting it again in 1 s"]
    finally:
        launcher.stop()


def test_each_role_gets_its_own_engine_options_after_everyones():
    """Heterogeneous boxes: the prefill instances on the accelerator, the decode ones on the
    CPU-hybrid rules; --instance-args gave every instance the same options."""
    spec = ClusterSpec(prefill=1, decode=2, instance_args=("--max-model-len", "256"),
                       role_args={"prefill": ("--placement", "device")})  # fmt: skip
    parts = {p.name: p for p in plan(spec, "python")}
    for p in parts.values():
        p.port = 1234
        if p.role:
            p.url = f"http://{p.address}"
    prefill = parts["prefill-0"].build(parts["prefill-0"])
    assert prefill[-4:] == ["--max-model-len", "256", "--placement", "device"]
    for name in ("decode-0", "decode-1"):
        cmd = parts[name].build(parts[name])
        assert cmd[-2:] == ["--max-model-len", "256"] and "--placement" not in cmd
    conductor = parts["conductor"].build(parts["conductor"])
    assert conductor[conductor.index("--decode") + 1 :][:2] == ["http://127.0.0.1:1234"] * 2


def test_a_conductor_the_ray_launcher_could_not_tell_is_told_at_the_next_supervise(monkeypatch):
    """An instance moved to another node while the Conductor was restarting: the call that
    adds its new address failed once and was never made again."""
    import httpx

    from hetserve.disagg.ray_launch import RayLauncher

    launcher = RayLauncher()
    launcher.running.parts.append(Part("conductor", url="http://127.0.0.1:9"))
    moved = Part("decode-0", role="decode", host="10.0.0.2", port=5, url="http://10.0.0.2:5")
    calls, down = [], {"now": True}

    def post(url, json, headers, timeout):
        calls.append((url, json))
        if down["now"]:
            raise httpx.ConnectError("connection refused")
        return httpx.Response(202)

    monkeypatch.setattr(httpx, "post", post)
    said = launcher._tell("POST", moved)
    assert "not told yet" in said and len(launcher.untold) == 1
    assert launcher.supervise() == []  # still down: tried again, nothing to say
    down["now"] = False
    assert launcher.supervise() == ["the Conductor was told where the moved instances are"]
    assert launcher.untold == [] and len(calls) == 3
    assert calls[-1] == ("http://127.0.0.1:9/internal/instances",
                         {"url": "http://10.0.0.2:5", "role": "decode"})  # fmt: skip


def test_a_start_called_off_stops_at_once_with_what_it_started(tmp_path):
    """Ctrl-C while `cluster up` started its parts was only heard once all of them answered
    (12 s for the demo model, minutes for a big one)."""
    import threading

    from hetserve.disagg.launch import LaunchCancelled

    # Listens only after 60 s: the launcher is still waiting for it when the start is called off
    slow = Part("slow", build=lambda p: [sys.executable, "-c",
                "import time; time.sleep(60)\n" + SERVER, str(p.port)])  # fmt: skip
    slow.log = tmp_path / "slow.log"
    launcher = LocalLauncher(ready_timeout_s=120, grace_s=2)
    threading.Timer(1.0, launcher.cancel.set).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(LaunchCancelled, match="while slow was starting"):
            launcher._start_part(slow)
        assert time.monotonic() - t0 < 10
    finally:
        launcher.stop()
    assert slow.proc.poll() is not None  # stopped, not left behind


def test_a_ray_address_where_nothing_listens_is_one_line_at_once():
    """Ray's client retried for minutes, printing its raw log lines, and ignored SIGTERM."""
    from hetserve.disagg.ray_launch import _reachable

    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=f"no Ray cluster answers at 127.0.0.1:{port}"):
        _reachable(f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 5
    with pytest.raises(LaunchError, match="wants HOST:PORT"):
        _reachable("head-node")
    _reachable("auto")  # Ray's to resolve
