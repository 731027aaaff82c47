"""`serve --role` over HTTP with a linear-attention model: a real prefill instance, decode
instance and Conductor on 127.0.0.1 (`cluster up`'s launcher, direct hand-off). The decode
instance resumes from the state the prefill instance shipped beside the blocks (engine-level
tests of that hand-off: test_handoff_engine.py); here the whole path answers an OpenAI request
as one colocated engine does."""

import httpx
import pytest

from hetserve import LLM, SamplingParams
from hetserve.disagg.cluster_spec import ClusterSpec
from hetserve.disagg.launch import LocalLauncher, free_port

ENGINE = ("--dtype", "float32", "--max-model-len", "256")
PROMPT = "The quick brown fox jumps over the lazy dog and runs into the forest to find friends"


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    model = str(tiny_model("qwen3-next", lm_head_scale=8.0))
    spec = ClusterSpec(
        model=model, prefill=1, decode=1, port=free_port(), instance_args=ENGINE,
        log_dir=str(tmp_path_factory.mktemp("cluster-logs")),
    )  # fmt: skip
    launcher = LocalLauncher(ready_timeout_s=240)
    running = launcher.start(spec)
    yield model, running
    procs = [p.proc for p in running.parts]
    launcher.stop()
    assert all(p.poll() is not None for p in procs)  # nothing left behind


def test_hybrid_model_through_prefill_and_decode_equals_colocated(cluster):
    model, running = cluster
    ref = LLM(model, dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    want = ref.generate(PROMPT, params)[0]
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "logprobs": 1}  # fmt: skip
    r = httpx.post(running.endpoint + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["choices"][0]["text"] == want.text
    lps = got["choices"][0]["logprobs"]["token_logprobs"]
    for mine, theirs in zip(lps, want.outputs[0].logprobs, strict=True):
        assert mine == pytest.approx(max(lp.logprob for lp in theirs.values()), abs=1e-5)
    # The decode instance took every prompt token but the last from the hand-off (blocks and
    # the linear-attention state after them), not from computing them again.
    usage = got["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
