"""LoRA adapters through the OpenAI server: the request's `model` picks the adapter, /v1/models
lists them as vLLM does, vLLM's load/unload endpoints work when enabled and are refused when not,
and every mistake is a 4xx OpenAI error body. Also `hetserve chat --url` against it, with its
timings."""

import argparse
import io

import httpx
import pytest

from hetserve import LLM, SamplingParams
from hetserve.config import EngineConfig, LoRAConfig
from hetserve.engine.async_llm import AsyncLLM
from hetserve.entrypoints.chat import chat_loop
from tests.lora_util import write_random_adapter
from tests.server.conftest import LiveServer

PROMPT = list(range(5, 30))


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    base = tiny_model("qwen3-moe", lm_head_scale=4.0)
    root = tmp_path_factory.mktemp("lora_server")
    sql = write_random_adapter(base, root / "sql", seed=1)
    chat = write_random_adapter(base, root / "chat", seed=2, match=r"q_proj|o_proj")
    lora = LoRAConfig(lora_modules=(("sql", str(sql)),), max_loras=2)
    engine = AsyncLLM(EngineConfig(model=str(base), max_model_len=256, lora=lora))
    servers = [LiveServer(engine), LiveServer(engine, lora_runtime_updates=True)]
    yield base, sql, chat, servers
    for s in servers:
        s.stop()
    engine.shutdown()


def complete(url, model, **kw):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **kw}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_model_field_picks_the_adapter(setup):
    base, sql, _, (srv, _) = setup
    r = complete(srv.url, "sql")
    assert r.status_code == 200 and r.json()["model"] == "sql"
    params = SamplingParams(temperature=0, max_tokens=6)
    offline = LLM(base, lora_modules={"sql": str(sql)})
    want = offline.generate(prompt_token_ids=PROMPT, sampling_params=params, lora_request="sql")
    assert r.json()["choices"][0]["text"] == want[0].text
    plain = complete(srv.url, "tiny").json()["choices"][0]["text"]
    assert plain != want[0].text
    chat = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        timeout=60,
    )
    assert chat.status_code == 200 and chat.json()["model"] == "sql"


def test_models_lists_adapters_as_vllm(setup):
    base, sql, _, (srv, _) = setup
    cards = {c["id"]: c for c in httpx.get(srv.url + "/v1/models").json()["data"]}
    assert cards["tiny"]["parent"] is None and cards["tiny"]["root"] == str(base)
    assert cards["sql"]["parent"] == "tiny" and cards["sql"]["root"] == str(sql)
    # hetserve's: the content id its requests' blocks are hashed with (a Conductor needs it)
    assert cards["sql"]["lora_id"] == srv.engine.lora_ids()["sql"] and cards["sql"]["lora_id"]


def test_unknown_model_is_404_json(setup):
    r = complete(setup[3][0].url, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'sql'" in r.json()["error"]["message"]


def test_runtime_updates_are_refused_unless_enabled(setup):
    srv = setup[3][0]
    for path in ("load_lora_adapter", "unload_lora_adapter"):
        r = httpx.post(f"{srv.url}/v1/{path}", json={"lora_name": "x", "lora_path": "/tmp"})
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "lora_runtime_updates_disabled"
        assert "--enable-lora-runtime-updates" in r.json()["error"]["message"]


def test_load_and_unload_at_runtime(setup, tmp_path):
    _, sql, chat, (_, srv) = setup
    load, unload = srv.url + "/v1/load_lora_adapter", srv.url + "/v1/unload_lora_adapter"
    r = httpx.post(load, json={"lora_name": "chat", "lora_path": str(chat)})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chat' added successfully."
    assert "chat" in {c["id"] for c in httpx.get(srv.url + "/v1/models").json()["data"]}
    assert complete(srv.url, "chat").status_code == 200
    bad = (tmp_path / "bad").mkdir() or tmp_path / "bad"
    mistakes = [
        ({"lora_name": "chat", "lora_path": str(chat)}, "already been loaded"),
        ({"lora_name": "tiny", "lora_path": str(chat)}, "base model's name"),
        ({"lora_name": "x", "lora_path": str(bad)}, "has no adapter_config.json"),
        ({"lora_name": "x", "lora_path": "/no/such"}, "is not a directory"),
        ({"lora_name": "x"}, "lora_path"),
        ({"lora_name": "", "lora_path": str(chat)}, "lora_name"),
    ]
    for body, message in mistakes:
        r = httpx.post(load, json=body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert httpx.post(load, content=b"{").status_code == 400
    r = httpx.post(unload, json={"lora_name": "chat"})
    assert r.status_code == 200 and "removed" in r.text
    r = httpx.post(unload, json={"lora_name": "chat"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_not_found"
    assert complete(srv.url, "chat").status_code == 404
    assert complete(srv.url, "sql").status_code == 200  # the others stay


def test_chat_url_picks_the_adapter_and_prints_timings(setup, monkeypatch, capsys):
    srv = setup[3][0]
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\n"))
    args = argparse.Namespace(
        url=srv.url, model="sql", lora=None, api_key=None, max_tokens=5, temperature=0.0
    )
    assert chat_loop(args) == 0
    lines = capsys.readouterr().out.splitlines()
    stats = dict(line.split(":", 1) for line in lines[-6:])
    assert list(stats) == [
        "prompt eval count", "prompt eval duration", "prompt eval rate",
        "eval count", "eval duration", "eval rate",
    ]  # fmt: skip
    assert stats["eval count"].strip() == "4 token(s)"  # 5 tokens, the first is the prompt's
    assert int(stats["prompt eval count"].split()[0]) > 0


def test_serve_command_wires_adapters_and_runtime_updates(setup, monkeypatch, capsys):
    """`hetserve serve --lora-modules ... --enable-lora-runtime-updates`, with uvicorn replaced
    by an in-process client of the app it would run."""
    from fastapi.testclient import TestClient

    from hetserve.cli import main

    base, sql, chat, _ = setup
    seen = {}

    def fake_run(app, **_):
        with TestClient(app) as client:
            seen["models"] = [c["id"] for c in client.get("/v1/models").json()["data"]]
            body = {"lora_name": "chat", "lora_path": str(chat)}
            seen["load"] = client.post("/v1/load_lora_adapter", json=body).status_code
            body = {"model": "chat", "prompt": PROMPT, "max_tokens": 2}
            seen["complete"] = client.post("/v1/completions", json=body).json()["model"]

    monkeypatch.setattr("uvicorn.run", fake_run)
    argv = ["serve", "--model", str(base), "--served-model-name", "tiny"]
    assert main([*argv, "--lora-modules", f"sql={sql}", "--enable-lora-runtime-updates"]) == 0
    assert seen == {"models": ["tiny", "sql"], "load": 200, "complete": "chat"}
    assert f"LoRA adapter 'sql' from {sql}" in capsys.readouterr().out
    assert main([*argv, "--lora-modules", f"tiny={sql}"]) == 2
    assert "is the base model's served name" in capsys.readouterr().err


def test_hybrid_family_adapter_through_the_server(tiny_model, tmp_path):
    """Qwen3-Next with an adapter on its Gated DeltaNet and full-attention projections, served
    (`serve --lora-modules`' engine): the HTTP reply equals the offline one, and the adapter
    changes it."""
    base = tiny_model("qwen3-next", lm_head_scale=4.0)
    adapter = write_random_adapter(base, tmp_path / "a", seed=3, match=r"linear_attn|self_attn")
    lora = LoRAConfig(lora_modules=(("lin", str(adapter)),))
    engine = AsyncLLM(EngineConfig(model=str(base), max_model_len=128, lora=lora))
    srv = LiveServer(engine)
    try:
        got = complete(srv.url, "lin").json()["choices"][0]["text"]
        plain = complete(srv.url, "tiny").json()["choices"][0]["text"]
    finally:
        srv.stop()
        engine.shutdown()
    params = SamplingParams(temperature=0, max_tokens=6)
    offline = LLM(base, lora_modules={"lin": str(adapter)})
    want = offline.generate(prompt_token_ids=PROMPT, sampling_params=params, lora_request="lin")
    assert got == want[0].text and got != plain
