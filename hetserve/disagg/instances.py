"""The Conductor's picture of its instances: who they are, how loaded, whether alive.

Who calls it: the Conductor service (`conductor.py`) on its event loop. `Cluster.start` asks
every instance for its facts (`GET /internal/info`: role, profile, hand-off address, KV block
size and hash seed); a poller then reads each one's load (`GET /internal/load`) every
`poll_s`, and marks an instance down after `down_after` failed polls in a row and up again at
the first good one. Between polls the Conductor counts what it routed itself (`routed`,
`finished`), so a burst does not all land on the instance that looked idle a moment ago.
`view` builds the policy's `ClusterView` from all of that plus the KV index's holdings.

An instance that does not answer at start (not started yet, restarting) joins when it does:
the poller asks it for its facts every `join_every_s` and adds it once they agree with the
cluster's (after `prepare`, which readies it: the adapters loaded on the cluster at run time);
`on_join` is told, so the KV index follows it from then on. Until then `status`
lists it as joining and nothing is routed to it. `add` makes a new instance join the same way
while the cluster runs (scaling out, or an instance moved to another machine), and `remove`
stops routing to one (`on_remove` is told; what it is serving finishes there). One that was
down and answers again may have restarted: its facts are read again and `prepare` runs before
anything is routed to it.

Failure contract: at start, no instance answering at all, an instance refusing the Conductor's
key, serving another role, or a cluster whose instances disagree on the KV identity (their
prefixes could never be shared) is a `ClusterError` naming it (one line). Later, failures only
mark instances down, and a joining instance that disagrees is logged (once per reason) and
asked again, never added.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from hetserve.config import Role
from hetserve.disagg.costs import InstanceProfile, profile_from_dict
from hetserve.disagg.instance_checks import KV_IDENTITY, handoff_refusal, identity_difference
from hetserve.disagg.policy import ClusterView, InstanceState, PrefixHolding
from hetserve.errors import HetserveError

log = logging.getLogger(__name__)


class ClusterError(HetserveError):
    """The cluster cannot be served as configured."""


@dataclass
class Instance:
    name: str
    url: str
    role: Role
    profile: InstanceProfile
    handoff: str | None  # where it receives hand-offs (decode instances)
    block_size: int
    hash_seed: bytes
    kv_dtype: str | None = None  # its KV cache's dtype, where it says (part of the identity)
    load: Mapping[str, int] = field(default_factory=dict)
    healthy: bool = True
    failures: int = 0
    # What the Conductor sent it since the last load poll: (tokens to prefill, decodes).
    routed_prefill: int = 0
    routed_requests: int = 0
    routed_decodes: int = 0

    def state(self) -> InstanceState:
        ld = self.load
        return InstanceState(
            self.name,
            self.role,
            self.profile,
            queued_prefill_tokens=ld.get("queued_prefill_tokens", 0) + self.routed_prefill,
            queued_requests=ld.get("queued_requests", 0) + self.routed_requests,
            running_decodes=ld.get("running_decodes", 0) + self.routed_decodes,
            decode_context_tokens=ld.get("decode_context_tokens", 0),
            free_blocks=ld.get("free_blocks", 0),
            total_blocks=ld.get("total_blocks", 0),
            healthy=self.healthy,
        )


class Cluster:
    def __init__(
        self,
        urls: Sequence[tuple[str, Role | None]],
        headers: Mapping[str, str] | None = None,
        poll_s: float = 0.1,
        down_after: int = 2,
        on_health: Callable[[str, bool], None] | None = None,
        info_timeout_s: float = 300.0,
        join_every_s: float = 2.0,
        handoff_path: str | None = None,
    ) -> None:
        self._urls = list(urls)
        # Told (name, healthy) when an instance goes down or comes back: the KV index resyncs
        # a returning instance at once (it may have restarted with an empty cache).
        self.on_health = on_health
        self.poll_s, self.down_after = poll_s, down_after
        self.info_timeout_s, self.join_every_s = info_timeout_s, join_every_s
        # Not answering yet: name -> (url, role asked of it), and when to ask next.
        self.joining: dict[str, tuple[str, Role | None]] = {}
        self._next_ask: dict[str, float] = {}
        self._asking: dict[str, asyncio.Task[None]] = {}
        self._refusal: dict[str, str] = {}  # the last reason a joiner was not added, per name
        self._refreshing: dict[str, asyncio.Task[None]] = {}  # back after down: facts re-read
        self.on_join: Callable[[Instance], Awaitable[None]] | None = None
        # Readies an instance before anything is routed to it: one that joins, or is back
        # after being down (perhaps restarted). Its failures are logged; the instance serves.
        self.prepare: Callable[[Instance], Awaitable[None]] | None = None
        self.on_remove: Callable[[str], None] | None = None
        self.http = httpx.AsyncClient(headers=dict(headers or {}), timeout=10.0)
        self.instances: dict[str, Instance] = {}
        self.block_size = 0
        self.hash_seed = b""
        self.model_card: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None
        # the path its hand-offs take: a prefill or decode instance that cannot take it is
        # refused (its every request waited out the decode side's timeout)
        self.handoff_path = handoff_path

    async def start(self) -> None:
        infos = await asyncio.gather(
            *(self._info(u) for u, _ in self._urls), return_exceptions=True
        )
        silent: list[str] = []
        for (url, role), info in zip(self._urls, infos, strict=True):
            if isinstance(info, httpx.TransportError):  # not up yet: it joins when it answers
                self.joining[_name(url)] = (url, role)
                silent.append(f"{url} ({self._why(info)})")
                continue
            if isinstance(info, BaseException):
                raise ClusterError(self._failure(url, info))
            inst = self._instance(url, role, info)
            self.instances[inst.name] = inst
        if not self.instances:
            raise ClusterError(f"no instance answered: {'; '.join(silent)}")
        for line in silent:
            log.warning("instance %s did not answer; it joins when it does", line)
        seeds = {i.hash_seed for i in self.instances.values()}
        sizes = {i.block_size for i in self.instances.values()}
        if len(seeds) > 1 or len(sizes) > 1:
            raise ClusterError(f"the instances disagree on {KV_IDENTITY}"
                               + identity_difference(list(self.instances.values())))  # fmt: skip
        self.block_size, self.hash_seed = sizes.pop(), seeds.pop()
        first = next(iter(self.instances.values()))
        r = await self.http.get(f"{first.url}/v1/models")
        if r.status_code == 200 and r.json().get("data"):
            self.model_card = dict(r.json()["data"][0])  # context, vocabulary: as served
        await self.poll_once()
        self._task = asyncio.get_running_loop().create_task(self._poll_forever())

    def _why(self, exc: BaseException) -> str:
        if isinstance(exc, httpx.TimeoutException):
            return (
                f"no answer to /internal/info in {self.info_timeout_s:.0f} s: an instance "
                "measures its cost profile at the first ask; give it one with --profile FILE "
                "from `hetserve profile`"
            )
        return str(exc) or type(exc).__name__

    def _failure(self, url: str, exc: BaseException) -> str:
        if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 401:
            return (
                f"instance {url} refused the Conductor's API key; give the Conductor the "
                "instances' key (--api-key, or HETSERVE_API_KEY if it differs from the clients')"
            )
        if isinstance(exc, httpx.HTTPStatusError):
            return f"instance {url} answered {exc.response.status_code} to /internal/info"
        if isinstance(exc, ClusterError):
            return str(exc)
        return f"instance {url} did not answer: {self._why(exc)}"

    async def join_pending(self) -> None:
        """Ask each joining instance whose turn has come for its facts (in the background:
        the first answer can take its profile measurement's seconds)."""
        now = asyncio.get_running_loop().time()
        for name, (url, role) in list(self.joining.items()):
            task = self._asking.get(name)
            if (task is None or task.done()) and now >= self._next_ask.get(name, 0.0):
                self._next_ask[name] = now + self.join_every_s
                self._asking[name] = asyncio.create_task(self._join(name, url, role))

    async def _join(self, name: str, url: str, role: Role | None) -> None:
        try:
            inst = await self._fresh(url, role)
        except (httpx.HTTPError, ValueError, KeyError, ClusterError) as exc:
            reason = self._failure(url, exc)
            if not isinstance(exc, httpx.TransportError) and self._refusal.get(name) != reason:
                self._refusal[name] = reason  # said once per reason, asked again later
                log.error("not adding %s: %s", name, reason)
            return
        if name not in self.joining:  # closed meanwhile
            return
        await self._prepare(inst)
        if name not in self.joining:
            return
        del self.joining[name]
        self._refusal.pop(name, None)
        self.instances[name] = inst
        log.warning("instance %s joined the cluster as %s", name, inst.role.value)
        if self.on_join is not None:
            try:
                await self.on_join(inst)
            except Exception:  # a listener's bug must not stop the cluster
                log.exception("join listener failed for %s", name)
            if self.instances.get(name) is not inst and self.on_remove is not None:
                self.on_remove(name)  # removed while the listener ran: undo what it began

    def add(self, url: str, role: Role | None) -> str:
        """Have the instance at `url` join while the cluster runs (asked at the next poll,
        added once its facts agree, as one that was down at start); its name. ClusterError
        if it is in the cluster already."""
        url = url.rstrip("/")
        name = _name(url)
        if name in self.instances or name in self.joining:
            raise ClusterError(f"instance {name} is in the cluster already")
        self.joining[name] = (url, role)
        self._next_ask.pop(name, None)
        return name

    def remove(self, name: str) -> bool:
        """Route nothing more to `name` (what it serves finishes there); False if unknown."""
        for tasks in (self._asking, self._refreshing):
            task = tasks.pop(name, None)
            if task is not None:
                task.cancel()
        self._next_ask.pop(name, None)
        self._refusal.pop(name, None)
        if self.instances.pop(name, None) is None and self.joining.pop(name, None) is None:
            return False
        log.warning("instance %s left the cluster", name)
        if self.on_remove is not None:
            try:
                self.on_remove(name)
            except Exception:  # a listener's bug must not stop the cluster
                log.exception("remove listener failed for %s", name)
        return True

    async def _fresh(self, url: str, role: Role | None) -> Instance:
        """The instance at `url` as it answers now; ClusterError if it cannot join this
        cluster (another role, another KV identity)."""
        inst = self._instance(url, role, await self._info(url))
        if (inst.block_size, inst.hash_seed) != (self.block_size, self.hash_seed):
            raise ClusterError(f"instance {url} disagrees with the cluster on {KV_IDENTITY}"
                               + identity_difference([inst, *self.instances.values()]))  # fmt: skip
        return inst

    async def _info(self, url: str) -> dict[str, Any]:
        # The first ask measures the instance's cost profile on its engine thread: seconds
        # alone, more on a loaded machine (CI once passed the client's 10 s read timeout).
        timeout = httpx.Timeout(10.0, read=self.info_timeout_s)
        r = await self.http.get(f"{url}/internal/info", timeout=timeout)
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data

    def _instance(self, url: str, role: Role | None, info: Mapping[str, Any]) -> Instance:
        served = Role(info["role"])
        if role is not None and served is not role and served is not Role.BOTH:
            raise ClusterError(f"instance {url} serves role {served.value}, not {role.value}")
        if served is not Role.BOTH:  # it hands off: over the Conductor's path?
            refusal = handoff_refusal(url, self.handoff_path, info.get("handoff_paths"))
            if refusal is not None:
                raise ClusterError(refusal)
        return Instance(
            _name(url),
            url,
            role or served,
            profile_from_dict(info["profile"]),
            info.get("handoff_address"),
            int(info["block_size"]),
            bytes.fromhex(info["hash_seed"]),
            info.get("kv_cache_dtype"),
        )

    async def _prepare(self, inst: Instance) -> None:
        if self.prepare is None:
            return
        try:
            await self.prepare(inst)
        except Exception:  # a listener's bug must not stop the cluster
            log.exception("preparing %s failed", inst.name)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(i) for i in self.instances.values()))

    async def _poll(self, inst: Instance) -> None:
        try:
            r = await self.http.get(f"{inst.url}/internal/load", timeout=max(1.0, 5 * self.poll_s))
            r.raise_for_status()
            load = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            inst.failures += 1
            if inst.healthy and inst.failures >= self.down_after:
                log.warning("instance %s is down (%s)", inst.name, exc)
                self._set_health(inst, False)
            return
        if not inst.healthy:
            task = self._refreshing.get(inst.name)
            if task is None or task.done():
                self._refreshing[inst.name] = asyncio.create_task(self._refresh(inst))
        inst.failures = 0
        inst.load = {k: int(v) for k, v in load.items() if isinstance(v, int | float)}
        inst.routed_prefill = inst.routed_requests = inst.routed_decodes = 0

    async def _refresh(self, inst: Instance) -> None:
        """An instance that was down answers again. It may have restarted: another hand-off
        address (a hand-off sent to the old one waited its whole timeout, then recomputed),
        another profile, even another model. Its facts are read again before anything is
        routed to it; one that now disagrees stays down (said once per reason)."""
        try:
            fresh = await self._fresh(inst.url, inst.role)
        except (httpx.HTTPError, ValueError, KeyError, ClusterError) as exc:
            reason = self._failure(inst.url, exc)
            if self._refusal.get(inst.name) != reason:
                self._refusal[inst.name] = reason
                log.error("instance %s answers again but stays down: %s", inst.name, reason)
            return
        if self.instances.get(inst.name) is not inst or inst.healthy:  # removed, or back
            return
        await self._prepare(inst)
        if self.instances.get(inst.name) is not inst or inst.healthy:
            return
        self._refusal.pop(inst.name, None)
        self._refreshing.pop(inst.name, None)
        inst.handoff, inst.profile = fresh.handoff, fresh.profile
        log.info("instance %s is back", inst.name)
        self._set_health(inst, True)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.join_pending()
            await self.poll_once()

    def mark_down(self, name: str) -> None:
        """A call to the instance failed outright: stop routing there until a poll answers."""
        inst = self.instances.get(name)
        if inst is None:  # removed meanwhile
            return
        inst.failures = self.down_after
        if inst.healthy:
            self._set_health(inst, False)

    def _set_health(self, inst: Instance, healthy: bool) -> None:
        inst.healthy = healthy
        if self.on_health is not None:
            try:
                self.on_health(inst.name, healthy)
            except Exception:  # a listener's bug must not stop the health checks
                log.exception("health listener failed for %s", inst.name)

    def routed(self, prefill: str | None, decode: str | None, new_tokens: int) -> None:
        if prefill in self.instances:
            self.instances[prefill].routed_prefill += new_tokens
            self.instances[prefill].routed_requests += 1
        if decode in self.instances:
            self.instances[decode].routed_decodes += 1

    def view(self, holdings: Mapping[str, Mapping[str, int]]) -> ClusterView:
        held = {h: PrefixHolding(h, b) for h, b in holdings.items()}
        return ClusterView([i.state() for i in self.instances.values()], held, self.block_size)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in (*self._asking.values(), *self._refreshing.values()):
            task.cancel()
        self.joining.clear()
        await self.http.aclose()

    def status(self, urls: bool = False) -> list[dict[str, Any]]:
        """One row per instance, for `cluster up`'s table and /health (`urls`: with their
        URLs, for the admin routes only)."""
        rows = [
            {"name": i.name, "role": i.role.value, "healthy": i.healthy, **dict(i.load)}
            | ({"url": i.url} if urls else {})
            for i in self.instances.values()
        ]
        return rows + [
            {"name": n, "role": role.value if role else "unknown", "healthy": False,
             "joining": True} | ({"url": url} if urls else {})  # fmt: skip
            for n, (url, role) in self.joining.items()
        ]


def _name(url: str) -> str:
    return url.removeprefix("http://").removeprefix("https://")
