"""What a new user meets first: an access line per request, vLLM's metric names that
dashboards chart (n=2 is one request), logprobs' bytes of a split character, and an unknown
route that says which APIs are served."""

import io
import sys

import httpx
import pytest

from hetserve.cli import main
from tests.server.conftest import LiveServer


@pytest.fixture(scope="module")
def logged(engine):
    srv = LiveServer(engine, log_requests=True)
    yield srv
    srv.stop()


def test_access_line_per_request(logged, access_lines):
    body = {"prompt": "hello the", "max_tokens": 5, "ignore_eos": True}
    httpx.post(logged.url + "/v1/completions", json=body, timeout=60)
    httpx.post(logged.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    httpx.post(logged.url + "/v1/completions", json={"prompt": 5}, timeout=60)
    httpx.get(logged.url + "/health")
    ok = [line for line in access_lines if '"POST /v1/completions" 200' in line]
    assert len(ok) == 2 and all("output_tokens=5" in line for line in ok), access_lines
    assert all("ttft=0." in line and "prompt_tokens=" in line for line in ok)
    assert any('"POST /v1/completions" 400' in line for line in access_lines)
    assert not any("/health" in line for line in access_lines)


def test_vllm_metric_names_and_n2_is_one_request(server):
    def scrape() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    before = scrape()
    body = {"prompt": "hello", "max_tokens": 3, "n": 2, "ignore_eos": True}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    server.wait_idle()
    after = scrape()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    m = '{model_name="tiny"}'
    assert delta('vllm:request_success_total{finished_reason="length",model_name="tiny"}') == 1
    assert delta(f"vllm:time_to_first_token_seconds_count{m}") == 1
    assert delta(f"vllm:request_generation_tokens_sum{m}") == 6
    for name in ("request_prompt_tokens", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "time_per_output_token_seconds", "iteration_tokens_total"):  # fmt: skip
        assert f"vllm:{name}_count{m}" in after, name
    assert delta(f"vllm:iteration_tokens_total_sum{m}") >= 6
    info = [k for k in after if k.startswith("vllm:cache_config_info")]
    assert info and 'block_size="16"' in info[0]


def test_logprob_bytes_of_a_split_character(server, engine):
    tok = engine.tokenizer
    ids = tok.encode("naïve é 你好")
    partial = next(t for t in ids if "\ufffd" in tok.decode([t]))  # a piece of a character
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": True,
            "top_logprobs": 0, "logit_bias": {str(partial): 100}}  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    entry = r["choices"][0]["logprobs"]["content"][0]
    assert bytes(entry["bytes"]) == tok.token_bytes(partial)
    assert 0xEF not in entry["bytes"][:1] and len(entry["bytes"]) < 3  # not U+FFFD's bytes


def test_unknown_route_says_what_is_served(server):
    r = httpx.get(server.url + "/v1/embeddings")
    assert r.status_code == 404
    msg = r.json()["error"]["message"]
    assert "/v1/chat/completions" in msg and "/api/chat" in msg
    assert "/api/" in httpx.post(server.url + "/api/nope").json()["error"]


def test_chat_commands_against_a_server(server, monkeypatch, capsys):
    script = "/system be brief\nhello\n/clear\n/help\nthe model\n/quit\nnever sent\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    seen = []
    real = server.engine.submit

    def spy(new):
        seen.append(server.engine.tokenizer.decode(new.prompt_token_ids, False))
        return real(new)

    monkeypatch.setattr(server.engine, "submit", spy)
    assert main(["chat", "--url", server.url, "--max-tokens", "3", "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert "/clear forgets" in err and "(conversation cleared)" in err
    assert len(seen) == 2  # /quit stopped before the last line
    assert "be brief" in seen[0] and "hello" in seen[0]
    assert "hello" not in seen[1] and "be brief" in seen[1]  # cleared, system prompt kept


def test_chat_takes_the_url_openai_clients_take(server, monkeypatch, capsys):
    """--url http://HOST:PORT/v1 (what OpenAI clients are given) asked /v1/v1/models: a 404."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", "--url", server.url + "/v1/", "--max-tokens", "2"]) == 0
    assert "404" not in capsys.readouterr().err
