"""The Conductor's view of its instances: health transitions reach a listener (the KV index),
once per change, from polls and from failed calls alike."""

import asyncio

import httpx
import pytest

from hetserve.config import Role
from hetserve.disagg.costs import DecodeFit, InstanceProfile, PrefillFit, profile_to_dict
from hetserve.disagg.instances import Cluster, ClusterError

PROFILE = profile_to_dict(
    InstanceProfile("t", PrefillFit(0.001, 0.0001, 0.0), DecodeFit(0.01, 0.001, 0.0), 1000)
)
INFO = {"role": "both", "profile": PROFILE, "block_size": 16, "hash_seed": ""}


def test_health_changes_are_told_once_each() -> None:
    up = {"on": True}
    seen: list[tuple[str, bool]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if not up["on"]:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/internal/load":
            return httpx.Response(200, json={"running_decodes": 0, "free_blocks": 10})
        return httpx.Response(404)

    async def run() -> None:
        cluster = Cluster([("http://a:1", None)], on_health=lambda n, h: seen.append((n, h)))
        cluster.http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        cluster.instances["a:1"] = cluster._instance("http://a:1", None, INFO)
        await cluster.poll_once()
        up["on"] = False
        await cluster.poll_once()  # one failure: not yet down
        assert seen == []
        await cluster.poll_once()
        await cluster.poll_once()
        assert seen == [("a:1", False)]
        up["on"] = True
        await cluster.poll_once()
        assert seen == [("a:1", False), ("a:1", True)]
        cluster.mark_down("a:1")
        cluster.mark_down("a:1")
        assert seen[-1] == ("a:1", False) and len(seen) == 3
        assert not cluster.instances["a:1"].healthy
        await cluster.http.aclose()

    asyncio.run(run())


def test_the_conductor_is_unhealthy_while_no_instance_can_decode() -> None:
    """A load balancer reads /health: with every decode instance down the Conductor refused
    every request while /health still answered 200 'ok' (one prefill instance was up)."""
    from hetserve.disagg.conductor import Conductor, ConductorConfig
    from hetserve.disagg.policy import Router, RouterConfig
    from hetserve.server.conductor_app import create_conductor_app

    async def run() -> None:
        cluster = Cluster([])
        for url, role in (("http://p:1", "prefill"), ("http://d:2", "decode")):
            inst = cluster._instance(url, None, {**INFO, "role": role})
            cluster.instances[inst.name] = inst
        app = create_conductor_app(
            Conductor(cluster, Router(RouterConfig()), None, ConductorConfig()), "m"
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
            assert (await client.get("/health")).status_code == 200
            cluster.mark_down("d:2")
            r = await client.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "degraded"
            # A request then is refused as the cluster's state, not the client's rate (it was
            # a 429 rate_limit_error, with admission off).
            cluster.block_size = INFO["block_size"]  # what the instances' info would set
            r = await client.post("/v1/completions", json={"prompt": [1, 2, 3]})
            assert r.status_code == 503 and r.headers["Retry-After"], r.text
            err = r.json()["error"]
            assert err["type"] == "service_unavailable" and "no healthy decode" in err["message"]
            cluster.instances["d:2"].healthy = True
            cluster.mark_down("p:1")
            assert (await client.get("/health")).status_code == 503
        await cluster.http.aclose()

    asyncio.run(run())


def test_the_first_info_waits_for_the_profile_and_a_timeout_says_so() -> None:
    """An instance measures its cost profile at the first /internal/info (seconds on its engine
    thread). CI once saw the Conductor give up at the client's 10 s read timeout, with the
    message "did not answer: " and nothing after it."""
    reads: list[float] = []

    def answer(request: httpx.Request) -> httpx.Response:
        reads.append(request.extensions["timeout"]["read"])
        raise httpx.ReadTimeout("", request=request)

    async def run() -> str:
        cluster = Cluster([("http://a:1", None)])
        cluster.http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        with pytest.raises(ClusterError) as err:
            await cluster.start()
        await cluster.http.aclose()
        return str(err.value)

    message = asyncio.run(run())
    assert reads == [300.0]  # the profile's time, not the polls' 10 s
    assert "in 300 s" in message and "--profile FILE" in message


def test_an_instance_down_at_start_joins_when_it_answers() -> None:
    """The Conductor refused to start while one instance was down (restarting, or started
    later); now it serves with the others and adds the late one once it answers, its KV index
    told (on_join), and a late one that disagrees on the KV identity is never added."""
    up = {"b:2": False, "c:3": True}
    seeds = {"a:1": "00", "b:2": "00", "c:3": "ff"}  # c serves another model

    def answer(request: httpx.Request) -> httpx.Response:
        host = f"{request.url.host}:{request.url.port}"
        if not up.get(host, True):
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/internal/info":
            return httpx.Response(200, json={**INFO, "hash_seed": seeds[host]})
        if request.url.path == "/internal/load":
            return httpx.Response(200, json={"running_decodes": 0, "free_blocks": 10})
        return httpx.Response(404)

    joined: list[str] = []

    async def follow(inst) -> None:
        joined.append(inst.name)

    async def run() -> None:
        urls = [("http://a:1", Role.PREFILL), ("http://b:2", Role.DECODE)]
        cluster = Cluster(urls, join_every_s=0.0)
        cluster.http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        cluster.on_join = follow
        await cluster.start()
        cluster._task.cancel()  # the test steps the joins itself
        assert list(cluster.instances) == ["a:1"]
        rows = {r["name"]: r for r in cluster.status()}
        assert rows["b:2"] == {"name": "b:2", "role": "decode", "healthy": False, "joining": True}
        await cluster.join_pending()
        await asyncio.gather(*cluster._asking.values())
        assert "b:2" not in cluster.instances and joined == []  # still down
        up["b:2"] = True
        await cluster.join_pending()
        await asyncio.gather(*cluster._asking.values())
        assert cluster.instances["b:2"].role is Role.DECODE and joined == ["b:2"]
        assert cluster.joining == {} and "joining" not in cluster.status()[1]
        # Another model's instance never joins, however often it is asked.
        cluster.joining["c:3"] = ("http://c:3", Role.DECODE)
        for _ in range(2):
            await cluster.join_pending()
            await asyncio.gather(*cluster._asking.values())
        assert "c:3" not in cluster.instances and "KV identity" in cluster._refusal["c:3"]
        await cluster.close()

    asyncio.run(run())


def test_no_instance_answering_at_start_is_an_error() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Connection refused", request=request)

    async def run() -> str:
        cluster = Cluster([("http://a:1", None), ("http://b:2", None)])
        cluster.http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        with pytest.raises(ClusterError) as err:
            await cluster.start()
        await cluster.close()
        return str(err.value)

    message = asyncio.run(run())
    assert message.startswith("no instance answered: http://a:1 (Connection refused)")
