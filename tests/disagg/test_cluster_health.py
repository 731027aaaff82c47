"""The Conductor's view of its instances: health transitions reach a listener (the KV index),
once per change, from polls and from failed calls alike."""

import asyncio

import httpx
import pytest

from hetserve.config import Role
from hetserve.disagg.costs import DecodeFit, InstanceProfile, PrefillFit, profile_to_dict
from hetserve.disagg.instances import Cluster, ClusterError
from hetserve.native.hash_chain import hash_prefix_digests

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
        if request.url.path == "/internal/info":
            return httpx.Response(200, json={**INFO, "handoff_address": handoff["at"]})
        return httpx.Response(404)

    async def back() -> None:  # the poll that sees it answer re-reads its facts first
        await cluster.poll_once()
        await asyncio.gather(*cluster._refreshing.values())

    handoff = {"at": "a:500"}
    cluster = Cluster([("http://a:1", None)], on_health=lambda n, h: seen.append((n, h)))

    async def run() -> None:
        cluster.http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        info = {**INFO, "handoff_address": "a:500"}
        cluster.instances["a:1"] = cluster._instance("http://a:1", None, info)
        cluster.block_size, cluster.hash_seed = 16, b""
        await cluster.poll_once()
        up["on"] = False
        await cluster.poll_once()  # one failure: not yet down
        assert seen == []
        await cluster.poll_once()
        await cluster.poll_once()
        assert seen == [("a:1", False)]
        up["on"] = True
        handoff["at"] = "a:501"  # it restarted: its hand-off listener is on another port
        await back()
        assert seen == [("a:1", False), ("a:1", True)]
        # Healthy only with the new address: hand-offs sent to the old one waited their whole
        # timeout (30 s) before the decode side recomputed.
        assert cluster.instances["a:1"].handoff == "a:501"
        cluster.mark_down("a:1")
        cluster.mark_down("a:1")
        assert seen[-1] == ("a:1", False) and len(seen) == 3
        assert not cluster.instances["a:1"].healthy
        INFO_SEED = INFO["hash_seed"]
        INFO["hash_seed"] = "ff"  # back as another model: it stays down
        try:
            await back()
            await back()
        finally:
            INFO["hash_seed"] = INFO_SEED
        assert not cluster.instances["a:1"].healthy and len(seen) == 3
        assert "KV identity" in cluster._refusal["a:1"]
        await back()
        assert cluster.instances["a:1"].healthy and seen[-1] == ("a:1", True)
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


def test_instances_are_added_and_removed_while_the_conductor_runs() -> None:
    """The instance list was fixed at start: a cluster could not grow, shrink, or take back an
    instance restarted at another address (the Ray launcher's, when a node is lost). Now
    POST /internal/instances makes one join once it answers (as one down at start), DELETE
    removes one (the KV index told), with SGLang router's /add_worker, /remove_worker and
    /list_workers beside them, all behind the Conductor's admin key: a client's key alone
    could add an instance of its own and be sent other users' prompts."""
    from hetserve.disagg.conductor import Conductor, ConductorConfig
    from hetserve.disagg.policy import Router, RouterConfig
    from hetserve.server.conductor_app import create_conductor_app

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/internal/info":
            role = {"p": "prefill", "d": "decode"}.get(request.url.host, "both")
            return httpx.Response(200, json={**INFO, "role": role})
        if request.url.path == "/internal/load":
            return httpx.Response(200, json={"running_decodes": 0, "free_blocks": 10})
        return httpx.Response(404)

    removed: list[str] = []

    async def run() -> None:
        cluster = Cluster([("http://p:1", Role.PREFILL), ("http://d:2", Role.DECODE)],
                          join_every_s=0.0)  # fmt: skip
        cluster.http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        await cluster.start()
        cluster._task.cancel()  # the test steps the joins itself
        cluster.on_remove = removed.append
        config = ConductorConfig(api_key="k", admin_key="a")
        app = create_conductor_app(Conductor(cluster, Router(RouterConfig()), None, config), "m")
        key = {"Authorization": "Bearer a"}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
            for method, path in (("POST", "/internal/instances"), ("POST", "/add_worker"),
                                 ("POST", "/remove_worker"), ("GET", "/list_workers"),
                                 ("DELETE", "/internal/instances/d:2"),
                                 ("GET", "/internal/instances")):  # fmt: skip
                for who in ({}, {"Authorization": "Bearer k"}):  # none, or the clients' key
                    r = await client.request(method, path, json={}, headers=who)
                    assert r.status_code == 401 and "admin key" in r.text, (path, r.text)
            assert "url" not in (await client.get("/health")).json()["instances"][0]
            r = await client.post("/internal/instances", headers=key,
                                  json={"url": "http://d:3/", "role": "decode"})  # fmt: skip
            assert r.status_code == 202 and r.json() == {"name": "d:3", "joining": True}
            await cluster.join_pending()
            await asyncio.gather(*cluster._asking.values())
            assert cluster.instances["d:3"].role is Role.DECODE
            listed = await client.get("/internal/instances", headers=key)
            assert [i["name"] for i in listed.json()["instances"]] == ["p:1", "d:2", "d:3"]
            for body, code, needle in (
                ({"url": "http://d:3", "role": "decode"}, 409, "in the cluster already"),
                ({"url": "d:4"}, 400, "want http://HOST:PORT"),
                ({"url": "http://d:4/v1"}, 400, "want http://HOST:PORT"),
                ({"url": "http://d:4"}, 202, ""),  # the role the instance serves
                ({"url": "http://d:5", "role": "leader"}, 400, "one of prefill, decode, both"),
                ([1], 400, "send {"),
            ):
                r = await client.post("/internal/instances", headers=key, json=body)
                assert r.status_code == code and needle in r.text, (body, r.text)
            r = await client.delete("/internal/instances/d:2", headers=key)
            assert r.status_code == 200 and removed == ["d:2"] and "d:2" not in cluster.instances
            r = await client.delete("/internal/instances/d:2", headers=key)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
            r = await client.post("/add_worker?url=http://b:6", headers=key)
            assert r.status_code == 202
            r = await client.get("/list_workers", headers=key)
            assert r.json()["urls"] == ["http://p:1", "http://d:3", "http://d:4", "http://b:6"]
            r = await client.post("/remove_worker?url=http://d:4", headers=key)
            assert r.status_code == 200 and removed == ["d:2", "d:4"]
        # Without an admin key: a caller on the Conductor's machine with the clients' key may,
        # one elsewhere may not.
        app = create_conductor_app(Conductor(cluster, Router(RouterConfig()), None,
                                             ConductorConfig(api_key="k")), "m")  # fmt: skip
        for host, with_key, code in (("127.0.0.1", True, 200), ("127.0.0.1", False, 401),
                                     ("10.1.2.3", True, 403)):  # fmt: skip
            transport = httpx.ASGITransport(app=app, client=(host, 5000))
            async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
                headers = {"Authorization": "Bearer k"} if with_key else {}
                r = await client.get("/list_workers", headers=headers)
                assert r.status_code == code, (host, with_key, r.text)
        await cluster.close()

    asyncio.run(run())


def test_a_stored_response_is_read_where_it_is_and_its_holder_down_is_a_503() -> None:
    from hetserve.disagg.conductor import Conductor, ConductorConfig, OtherAPI
    from hetserve.disagg.policy import Router, RouterConfig
    from hetserve.server.conductor_app import create_conductor_app

    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path.startswith("/v1/responses/"):
            asked.append(host)
            if host == "d2" and request.url.path.endswith("resp_1"):
                return httpx.Response(200, json={"id": "resp_1", "object": "response"})
            return httpx.Response(404, json={"error": {"message": "not found"}})
        return httpx.Response(404)

    async def run() -> None:
        cluster = Cluster([])
        cluster.http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        for url, role in (("http://p1:1", "prefill"), ("http://d1:2", "decode"),
                          ("http://d2:3", "decode")):  # fmt: skip
            inst = cluster._instance(url, None, {**INFO, "role": role})
            cluster.instances[inst.name] = inst
        conductor = Conductor(cluster, Router(RouterConfig()), None, ConductorConfig())
        conductor.apis["/v1/responses"] = OtherAPI(lambda b: b, lambda b: b)
        app = create_conductor_app(conductor, "m")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
            r = await client.get("/v1/responses/resp_1")
            assert r.status_code == 200 and r.json()["id"] == "resp_1"
            assert sorted(asked) == ["d1", "d2", "d2"]  # both decoders asked, then its holder
            asked.clear()
            assert (await client.get("/v1/responses/resp_1")).status_code == 200
            assert asked == ["d2"]  # remembered
            r = await client.get("/v1/responses/resp_9")
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
            cluster.mark_down("d2:3")
            r = await client.post("/v1/responses", json={"input": "hi",
                                                         "previous_response_id": "resp_1"})
            assert r.status_code == 503 and r.headers["Retry-After"]
            assert "d2:3" in r.json()["error"]["message"]
            # Not found while a decode instance is down: perhaps there; not a 404 yet.
            r = await client.get("/v1/responses/resp_9")
            assert r.status_code == 503 and "down" in r.json()["error"]["message"]
        await cluster.http.aclose()

    asyncio.run(run())


def test_lora_adapters_are_loaded_on_every_instance_and_listed() -> None:
    """vLLM's runtime adapter routes were 404s at the Conductor, and its /v1/models listed the
    base model alone: a cluster's adapters could be neither loaded nor found through it."""
    from hetserve.disagg.conductor import Conductor, ConductorConfig
    from hetserve.disagg.policy import Router, RouterConfig
    from hetserve.server.conductor_app import create_conductor_app

    posted: list[tuple[str, str]] = []
    refuse = {"host": None}

    def answer(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [
                {"id": "base", "root": "/m"},
                {"id": "sql", "root": "/adapters/sql", "parent": "base",
                 "lora_id": "c0ffee"}]})  # fmt: skip
        if request.url.path.endswith("_lora_adapter"):
            posted.append((host, request.url.path))
            if host == refuse["host"]:
                return httpx.Response(400, json={"error": {"message": "already loaded"}})
            return httpx.Response(200, text="Success: LoRA adapter 'sql' added successfully.")
        return httpx.Response(404)

    async def run() -> None:
        cluster = Cluster([])
        cluster.http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        for url, role in (("http://p:1", "prefill"), ("http://d:2", "decode")):
            inst = cluster._instance(url, None, {**INFO, "role": role})
            cluster.instances[inst.name] = inst
        cluster.model_card = {"id": "base", "root": "/m", "max_model_len": 256}
        cluster.block_size, cluster.hash_seed = 16, b""
        hashed: list[list[bytes]] = []
        conductor = Conductor(cluster, Router(RouterConfig()), None, ConductorConfig(),
                              holdings=lambda hs: hashed.append(list(hs)) or {})  # fmt: skip
        app = create_conductor_app(conductor, "listed")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
            cards = (await client.get("/v1/models")).json()["data"]
            assert [(c["id"], c.get("parent")) for c in cards] == [("listed", None),
                                                                  ("sql", "listed")]
            assert not any("root" in c for c in cards)  # the instances' paths stay theirs
            assert (await client.get("/v1/models/sql")).json()["parent"] == "listed"
            for method, path, code in (("GET", "/nope", 404), ("GET", "/v1/completions", 405),
                                       ("POST", "/v1/models", 405)):  # fmt: skip
                r = await client.request(method, path)  # OpenAI's error shape, not FastAPI's
                assert r.status_code == code and r.json()["error"]["message"], r.text
            missing = await client.get("/v1/models/other")
            assert missing.status_code == 404
            assert missing.json()["error"]["code"] == "model_not_found"
            body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
            r = await client.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == 200 and "(on 2 instances)" in r.text
            assert sorted(posted) == [("d", "/v1/load_lora_adapter"),
                                      ("p", "/v1/load_lora_adapter")]  # fmt: skip
            refuse["host"] = "d"
            r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
            assert r.status_code == 400
            assert r.json()["error"]["message"] == (
                "1 of 2 instances refused (d:2: already loaded); 1 did it")
            # An adapter request's blocks are hashed as the instances hash them: with the
            # adapter's content id (no KV is shared across adapters), the base's without.
            ids = list(range(1, 41))
            for model, extra in (("sql", ("lora:c0ffee",)), ("base", ())):
                conductor.adapters.ids.clear()  # learned again from an instance's cards
                conductor.adapters._asked = -1e9
                await client.post("/v1/completions", json={"model": model, "prompt": ids})
                want = [h.digest for h in hash_prefix_digests(ids, 16, extra, b"")]
                assert hashed[-1] == want, model
        await cluster.http.aclose()

    asyncio.run(run())


def test_runtime_adapters_reach_instances_that_join_or_restart_later() -> None:
    """An adapter loaded through the Conductor reached the instances of that moment only: an
    instance added later, or one restarted (which loses what was loaded at run time), answered
    404 for it while the Conductor routed its requests there."""
    from hetserve.disagg.conductor import Conductor, ConductorConfig
    from hetserve.disagg.policy import Router, RouterConfig
    from hetserve.server.conductor_app import create_conductor_app

    up = {"a": True, "b": True, "c": True}
    loaded: dict[str, set[str]] = {"a": set(), "b": set(), "c": set()}

    def answer(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if not up[host]:
            raise httpx.ConnectError("refused", request=request)
        path = request.url.path
        if path == "/internal/info":
            return httpx.Response(200, json=INFO)
        if path == "/internal/load":
            return httpx.Response(200, json={"running_decodes": 0, "free_blocks": 10})
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "base"}]})
        if path.endswith("_lora_adapter"):
            name = httpx.Response(200, content=request.content).json()["lora_name"]
            if path == "/v1/load_lora_adapter":
                if name in loaded[host]:
                    return httpx.Response(400, json={"error": {
                        "message": f"The lora adapter '{name}' has already been loaded."}})
                loaded[host].add(name)
            else:
                loaded[host].discard(name)
            return httpx.Response(200, text="Success")
        return httpx.Response(404)

    async def run() -> None:
        cluster = Cluster([], join_every_s=0.0)
        cluster.http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        inst = cluster._instance("http://a:1", None, INFO)
        cluster.instances[inst.name] = inst
        cluster.model_card = {"id": "base", "max_model_len": 256}
        cluster.block_size, cluster.hash_seed = 16, b""
        conductor = Conductor(cluster, Router(RouterConfig()), None, ConductorConfig(),
                              holdings=lambda hs: {})  # fmt: skip
        app = create_conductor_app(conductor, "base")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
            for name in ("sql", "chat"):
                r = await client.post("/v1/load_lora_adapter",
                                      json={"lora_name": name, "lora_path": f"/ad/{name}"})
                assert r.status_code == 200
            r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
            assert r.status_code == 200
            assert loaded["a"] == {"sql"}
            # b is added while the Conductor runs: it has the adapter before it serves
            cluster.add("http://b:2", None)
            await cluster.join_pending()
            await asyncio.gather(*cluster._asking.values())
            assert "b:2" in cluster.instances and loaded["b"] == {"sql"}
            # a restarts (its runtime adapters gone): loaded again before it is back
            up["a"], loaded["a"] = False, set()
            for _ in range(3):
                await cluster.poll_once()
            assert not cluster.instances["a:1"].healthy
            up["a"] = True
            await cluster.poll_once()
            await asyncio.gather(*cluster._refreshing.values())
            assert cluster.instances["a:1"].healthy and loaded["a"] == {"sql"}
            # down and back without a restart: it has it already, and stays healthy
            cluster.mark_down("b:2")
            await cluster.poll_once()
            await asyncio.gather(*cluster._refreshing.values())
            assert cluster.instances["b:2"].healthy and loaded["b"] == {"sql"}
        await cluster.http.aclose()

    asyncio.run(run())


def test_instances_that_disagree_on_the_kv_dtype_are_told_which_flag_differs() -> None:
    """The README's own role_args example (prefill on --placement device) stopped at 'the
    instances disagree on the KV identity' without saying that the KV dtype was what differed
    (fp32 with the device placement, fp16 with all-int8)."""
    dtypes = {"a": "float32", "b": "float16"}

    def answer(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/internal/info":
            return httpx.Response(200, json={**INFO, "hash_seed": "0a" if host == "a" else "0b",
                                             "kv_cache_dtype": dtypes[host]})  # fmt: skip
        return httpx.Response(200, json={})

    async def run() -> None:
        cluster = Cluster([("http://a:1", Role.PREFILL), ("http://b:2", Role.DECODE)])
        cluster.http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        with pytest.raises(ClusterError) as err:
            await cluster.start()
        assert "KV cache dtype: a:1 float32, b:2 float16" in str(err.value)
        assert "--kv-cache-dtype" in str(err.value)
        await cluster.close()

    asyncio.run(run())


def test_an_instance_that_cannot_take_the_handoff_path_is_refused() -> None:
    """`conductor --handoff-path mooncake` beside instances started without --handoff-mooncake:
    every request waited out the decode side's 30 s before it recomputed."""
    paths = {"a": ["direct", "mooncake"], "b": ["direct"]}

    def answer(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        role = "prefill" if host == "a" else "decode"
        return httpx.Response(200, json={**INFO, "role": role, "handoff_paths": paths[host]})

    async def run(path: str) -> Cluster:
        cluster = Cluster([("http://a:1", Role.PREFILL), ("http://b:2", Role.DECODE)],
                          handoff_path=path)  # fmt: skip
        cluster.http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        try:
            await cluster.start()
        finally:
            if cluster._task is not None:
                cluster._task.cancel()
            await cluster.close()
        return cluster

    with pytest.raises(ClusterError) as err:
        asyncio.run(run("mooncake"))
    assert "b:2 cannot hand KV off over mooncake" in str(err.value)
    assert "--handoff-mooncake" in str(err.value)
    assert set(asyncio.run(run("direct")).instances) == {"a:1", "b:2"}
