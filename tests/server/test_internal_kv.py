"""/internal/kv_info and /internal/kv_snapshot on a live server with KV events on, behind its
API key; an index that follows it over HTTP and ZMQ finds the prompt it just served."""

import time

import httpx
import pytest

from hetserve.config import EngineConfig
from hetserve.core.block_hash import hash_prefix_blocks
from hetserve.disagg.kv_subscriber import KVEventSubscriber
from hetserve.engine.async_llm import AsyncLLM

from .conftest import LiveServer

KEY = "k-internal"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = list(range(5, 75))  # four full blocks of 16


@pytest.fixture(scope="module")
def live(tiny_model):
    config = EngineConfig.from_options(
        model=str(tiny_model("qwen3-moe")), max_model_len=256, kv_events="tcp://127.0.0.1:0"
    )
    engine = AsyncLLM(config)
    srv = LiveServer(engine, api_key=KEY)
    yield srv
    srv.stop()
    engine.shutdown()


def test_internal_routes_need_the_api_key(live):
    for path in ("/internal/kv_info", "/internal/kv_snapshot", "/internal/load"):
        r = httpx.get(live.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        bad = httpx.get(live.url + path, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401
        assert httpx.get(live.url + path, headers=AUTH).status_code == 200


def test_snapshot_and_index_follow_a_served_prompt(live):
    info = httpx.get(live.url + "/internal/kv_info", headers=AUTH).json()
    assert info["kv_events"]["endpoint"].startswith("tcp://127.0.0.1:")
    sub = KVEventSubscriber()
    try:
        assert sub.add("s", live.url, KEY)["hash_seed"] == info["hash_seed"]
        time.sleep(0.3)  # ZMQ's slow joiner; a batch published meanwhile is replayed anyway
        body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
        r = httpx.post(live.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        seed = bytes.fromhex(info["hash_seed"])
        digests = [h.digest for h in hash_prefix_blocks(PROMPT, info["block_size"], (), seed)]
        snap = httpx.get(live.url + "/internal/kv_snapshot", headers=AUTH).json()
        assert snap["seq"] >= 0 and snap["ts"] > 0
        assert {d.hex() for d in digests} <= set(snap["blocks"]["GPU"])
        deadline = time.monotonic() + 10
        while sub.holdings(digests).get("s", {}).get("device") != 4:
            assert time.monotonic() < deadline, sub.stats()
            time.sleep(0.02)
    finally:
        sub.close()


def test_snapshot_is_404_while_kv_events_are_off(server):
    r = httpx.get(server.url + "/internal/kv_snapshot")
    assert r.status_code == 404 and "--kv-events" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/internal/kv_info").json()["kv_events"] is None
