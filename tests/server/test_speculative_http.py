"""A server with speculative decoding: completions, streamed or not, are those of an engine
without drafts, and /metrics reports drafts checked and held under vLLM's names."""

import httpx
import pytest

from hetserve import LLM, SamplingParams
from hetserve.config import EngineConfig
from hetserve.engine.async_llm import AsyncLLM
from tests.server.conftest import LiveServer

OPTIONS = {"max_model_len": 512, "kv_cache_dtype": "float32"}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
PROMPTS = ["a b c d e f a b c d e f a b c", "hello the model " * 4]


@pytest.fixture(scope="module")
def served(tiny_model):
    model = str(tiny_model("qwen3-moe"))
    engine = AsyncLLM(EngineConfig.from_options(model=model, speculative_config=SPEC, **OPTIONS))
    srv = LiveServer(engine)
    yield srv, model
    srv.stop()
    engine.shutdown()


def test_completions_equal_decodings_and_metrics_count_drafts(served):
    srv, model = served
    plain = LLM(EngineConfig.from_options(model=model, **OPTIONS))
    body = {"model": "tiny", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    want = [o.outputs[0].text for o in plain.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))]  # fmt: skip
    for prompt, text in zip(PROMPTS, want, strict=True):
        r = httpx.post(srv.url + "/v1/completions", json={**body, "prompt": prompt}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
        assert r.json()["usage"]["completion_tokens"] == 40
        streamed = ""
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                          json={**body, "prompt": prompt, "stream": True}) as s:  # fmt: skip
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    streamed += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
        assert streamed == text
    metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    values = {line.split(" ")[0].split("{")[0]: float(line.rsplit(" ", 1)[1])
              for line in metrics.splitlines() if line.startswith(("vllm:spec", "hetserve_spec"))}
    assert values["vllm:spec_decode_num_draft_tokens_total"] > 0
    held = values["vllm:spec_decode_num_accepted_tokens_total"]
    assert 0 < held <= values["vllm:spec_decode_num_draft_tokens_total"]
    assert values["hetserve_spec_decode_acceptance_rate"] == pytest.approx(
        held / values["hetserve_spec_decode_draft_tokens_total"])


def test_chat_prediction_drafts_and_reports_its_tokens_through_the_sdk(served):
    """OpenAI's Predicted Outputs with the official client: the reply is the one without a
    prediction; usage counts the prediction's tokens that held and those that did not."""
    openai = pytest.importorskip("openai")
    srv, _ = served
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "rewrite the file"}],
           "max_tokens": 40, "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
    plain = client.chat.completions.create(**ask)
    text = plain.choices[0].message.content
    details = plain.usage.completion_tokens_details  # a thinking model's: reasoning only
    assert details is None or details.accepted_prediction_tokens is None
    edited = text[: len(text) // 2] + " an inserted line " + text[len(text) // 2 :]
    parts = [{"type": "text", "text": text}]
    for content in (edited, parts):
        prediction = {"type": "content", "content": content}
        r = client.chat.completions.create(**ask, prediction=prediction)
        assert r.choices[0].message.content == text
        details = r.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0
        assert details.rejected_prediction_tokens >= 0
    # streamed, with usage at the end
    chunks = list(client.chat.completions.create(
        **ask, prediction={"type": "content", "content": text}, stream=True,
        stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0


@pytest.mark.parametrize(
    "prediction, words",
    [
        ({"type": "image", "content": "x"}, "prediction.type"),
        ({"type": "content"}, "prediction.content"),
        ({"type": "content", "content": [{"type": "image_url", "image_url": "x"}]},
         "prediction.content"),
        ({"type": "content", "content": "x", "extra": 1}, "prediction.extra"),
    ],
)
def test_a_malformed_prediction_is_a_400_naming_it(served, prediction, words):
    srv, _ = served
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "prediction": prediction}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["param"] or words in r.json()["error"]["message"]
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
