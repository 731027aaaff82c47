"""A real cluster on 127.0.0.1 (`hetserve cluster up`'s launcher): pool store, one prefill and
two decode instances, the Conductor. Disaggregated outputs equal a colocated engine's; a
killed decode instance is routed around and rejoins; an overloaded Conductor with predictive
admission answers 429 with Retry-After and every KV block comes back; SIGTERM to `cluster up`
stops every process it started."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from hetserve import LLM, SamplingParams
from hetserve.disagg.cluster_spec import ClusterSpec
from hetserve.disagg.launch import LocalLauncher, free_port

ENGINE = ("--dtype", "float32", "--max-model-len", "256")
PROMPT = "The quick brown fox jumps over the lazy dog and runs into the forest to find friends"


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    model = str(tiny_model("qwen3-moe"))
    spec = ClusterSpec(
        model=model, prefill=1, decode=2, store="pool", store_dram="128M", port=free_port(),
        instance_args=ENGINE, log_dir=str(tmp_path_factory.mktemp("cluster-logs")),
    )  # fmt: skip
    launcher = LocalLauncher(ready_timeout_s=240)
    running = launcher.start(spec)
    yield model, spec, launcher, running
    procs = [p.proc for p in running.parts]
    launcher.stop()
    assert all(p.poll() is not None for p in procs)  # nothing left behind


def complete(url, **extra):
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(url + "/completions", json=body, timeout=120)


def test_disaggregated_equals_colocated(cluster):
    model, _, _, running = cluster
    ref = LLM(model, dtype="float32", max_model_len=256)
    want = ref.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                               logprobs=1))[0]  # fmt: skip
    card = httpx.get(running.endpoint + "/models", timeout=10).json()["data"][0]
    assert card["max_model_len"] == 256 and card["vocab_size"] > 0  # what clients size by
    r = complete(running.endpoint, logprobs=1)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]
    assert got["text"] == want.text
    lps = got["logprobs"]["token_logprobs"]
    for mine, theirs in zip(lps, want.outputs[0].logprobs, strict=True):
        assert mine == pytest.approx(max(lp.logprob for lp in theirs.values()), abs=1e-5)
    # Streamed: the same text, and the stream ends with [DONE].
    with httpx.stream("POST", running.endpoint + "/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
        "stream": True}) as s:  # fmt: skip
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"


def test_a_killed_decode_instance_is_routed_around_and_rejoins(cluster):
    _, _, launcher, running = cluster
    decodes = [p for p in running.parts if p.name.startswith("decode")]
    victim = decodes[0]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    for _ in range(4):  # whatever the policy picks, every request is served
        r = complete(running.endpoint)
        assert r.status_code == 200, r.text
    health = httpx.get(running.endpoint.removesuffix("/v1") + "/health", timeout=10).json()
    down = [i for i in health["instances"] if i["name"].endswith(str(victim.port))]
    assert down and down[0]["healthy"] is False
    # `cluster up`'s supervisor starts it again on its port, and the poller sees it back.
    assert launcher.supervise() == [
        f"{victim.name} was killed by SIGKILL; starting it again in 1 s"
    ]
    said = launcher.supervise(victim.restart_at)
    assert said == [f"{victim.name} started again (restart 1, log {victim.log})"]
    launcher._wait(victim)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = httpx.get(running.endpoint.removesuffix("/v1") + "/health", timeout=10).json()
        if all(i["healthy"] for i in health["instances"]):
            break
        time.sleep(0.2)
    assert all(i["healthy"] for i in health["instances"])


def test_a_conductor_started_while_an_instance_is_down_adds_it_when_it_answers(
    cluster, tmp_path
):
    """It refused to start ("instance ... did not answer"): a Conductor restarted while an
    instance restarts too would have stayed down."""
    model, _, launcher, running = cluster
    parts = {p.name: p for p in running.parts}
    victim = parts["decode-1"]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    port = free_port()
    cmd = [sys.executable, "-m", "hetserve.cli", "conductor", "--model", model, "--port",
           str(port), "--prefill", parts["prefill-0"].url, "--decode", parts["decode-0"].url,
           victim.url]  # fmt: skip
    log_path = tmp_path / "late.log"
    log = open(log_path, "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        health = _wait_health(base, proc, log_path, lambda h: True)
        rows = {i["name"]: i for i in health["instances"]}
        assert rows[victim.url.removeprefix("http://")]["joining"] is True
        assert complete(base + "/v1").status_code == 200  # served by the others meanwhile
        launcher.supervise()
        launcher.supervise(victim.restart_at)
        launcher._wait(victim)
        health = _wait_health(base, proc, log_path,
                              lambda h: all(i["healthy"] for i in h["instances"]))  # fmt: skip
        assert not any(i.get("joining") for i in health["instances"])
        for _ in range(4):
            r = complete(base + "/v1")
            assert r.status_code == 200, r.text
        assert "joined the cluster as decode" in log_path.read_text()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
        log.close()


def _wait_health(base, proc, log_path, ready, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log_path.read_text()
        try:
            health = httpx.get(base + "/health", timeout=2).json()
            if ready(health):
                return health
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not ready in {timeout_s} s: {log_path.read_text()}")


def test_predictive_admission_rejects_and_blocks_come_back(cluster, tmp_path):
    model, spec, _, running = cluster
    urls = {p.name: p.url for p in running.parts if p.url}
    port = free_port()
    cmd = [sys.executable, "-m", "hetserve.cli", "conductor", "--model", model, "--port",
           str(port), "--prefill", urls["prefill-0"], "--decode", urls["decode-0"],
           urls["decode-1"], "--admission", "predictive", "--slo-ttft-ms", "0.001"]  # fmt: skip
    log = open(tmp_path / "strict.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "strict.log").read_text()
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        r = complete(base + "/v1")
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        for name in ("prefill-0", "decode-0", "decode-1"):
            load = httpx.get(urls[name] + "/internal/load", timeout=10).json()
            assert load["free_blocks"] == load["total_blocks"]  # nothing held for it
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
        log.close()


def test_cluster_up_stops_everything_on_sigterm(tiny_model, tmp_path):
    port = free_port()
    model = str(tiny_model("qwen3-moe"))
    logs = str(tmp_path / "logs")
    cmd = [sys.executable, "-m", "hetserve.cli", "cluster", "up", "--both", "1", "--prefill",
           "0", "--decode", "0", "--model", model, "--port", str(port),
           "--log-dir", logs, "--instance-args", "--max-model-len 256"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    children = []
    try:
        for line in proc.stdout:
            if line.startswith("cluster ready"):
                break
        out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
        children = [int(p) for p in out.stdout.split()]
        assert len(children) == 2  # the instance and the Conductor
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except OSError:
        return True


def test_anthropic_messages_through_the_cluster_equal_one_instances(cluster):
    """Claude Code's API through a disaggregated cluster: the prefill instance computes the
    chat request the Messages body means, the decode instance takes its KV and answers in
    Anthropic's shape, as one instance alone does."""
    _, _, _, running = cluster
    parts = {p.name: p for p in running.parts}
    body = {"model": httpx.get(running.endpoint + "/models", timeout=10).json()["data"][0]["id"],
            "max_tokens": 8, "temperature": 0, "system": "be brief",
            "messages": [{"role": "user", "content": PROMPT}]}  # fmt: skip
    alone = httpx.post(parts["decode-0"].url + "/v1/messages", json=body, timeout=120)
    assert alone.status_code == 200, alone.text
    base = running.endpoint.removesuffix("/v1")
    before = httpx.get(base + "/metrics", timeout=10).text
    r = httpx.post(base + "/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["content"] == alone.json()["content"]
    after = httpx.get(base + "/metrics", timeout=10).text
    assert _count(after, "disaggregated") == _count(before, "disaggregated") + 1
    usage = r.json()["usage"]  # the decode instance took the prompt from the hand-off
    assert usage["cache_read_input_tokens"] > 0


def _count(metrics: str, outcome: str) -> int:
    line = f'hetserve_conductor_requests_total{{outcome="{outcome}"}}'
    return next((int(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith(line)), 0)


def test_responses_through_the_cluster_go_where_their_conversation_is(cluster):
    """The Conductor answered /v1/responses with a 404: agents on OpenAI's Responses API could
    not use a cluster. A stateless request is now disaggregated as the chat request it means;
    a continuation (previous_response_id) and reads, cancels and deletes go to the decode
    instance that stored the response, found by asking the instances."""
    _, _, _, running = cluster
    parts = {p.name: p for p in running.parts}
    decoders = [parts["decode-0"].url, parts["decode-1"].url]
    base = running.endpoint.removesuffix("/v1")
    model = httpx.get(running.endpoint + "/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "input": PROMPT, "max_output_tokens": 8, "temperature": 0,
            "instructions": "be brief"}  # fmt: skip
    alone = httpx.post(decoders[0] + "/v1/responses", json=body, timeout=120).json()
    before = httpx.get(base + "/metrics", timeout=10).text
    first = httpx.post(base + "/v1/responses", json=body, timeout=120)
    assert first.status_code == 200, first.text
    first = first.json()
    assert first["output"] == [{**o, "id": m["id"]} for o, m in zip(alone["output"],
                                                                   first["output"],
                                                                   strict=True)]  # fmt: skip
    after = httpx.get(base + "/metrics", timeout=10).text
    assert _count(after, "disaggregated") == _count(before, "disaggregated") + 1

    def holders(rid):
        return [u for u in decoders
                if httpx.get(f"{u}/v1/responses/{rid}", timeout=10).status_code == 200]

    [holder] = holders(first["id"])
    rid = first["id"]
    for turn in range(3):  # each continues the last: it must reach the instance holding it
        nxt = httpx.post(base + "/v1/responses", timeout=120, json={
            "model": model, "input": f"and then {turn}?", "previous_response_id": rid,
            "max_output_tokens": 4, "temperature": 0})  # fmt: skip
        assert nxt.status_code == 200, nxt.text
        rid = nxt.json()["id"]
        assert holders(rid) == [holder]
    got = httpx.get(f"{base}/v1/responses/{first['id']}", timeout=10)
    assert got.status_code == 200 and got.json()["output"] == first["output"]
    listed = httpx.get(f"{base}/v1/responses/{rid}/input_items", timeout=10).json()
    assert [i["content"][0]["text"] for i in listed["data"]] == ["and then 2?"]
    count = {"model": model, "input": "more", "previous_response_id": rid}
    counts = [httpx.post(f"{u}/v1/responses/input_tokens", json=count, timeout=30)
              for u in (base, holder)]  # the Conductor's answer is the holder's  # fmt: skip
    assert counts[0].status_code == 200 and counts[0].json() == counts[1].json()
    stateless = httpx.post(f"{base}/v1/responses/input_tokens", timeout=30,
                           json={"model": model, "input": "more"})  # fmt: skip
    assert 0 < stateless.json()["input_tokens"] < counts[0].json()["input_tokens"]
    # In the background: queued at once, read through the Conductor until it completes.
    queued = httpx.post(base + "/v1/responses", json={**body, "background": True}, timeout=120)
    assert queued.status_code == 200 and queued.json()["status"] in ("queued", "in_progress")
    bid = queued.json()["id"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = httpx.get(f"{base}/v1/responses/{bid}", timeout=10).json()
        if state["status"] not in ("queued", "in_progress"):
            break
        time.sleep(0.2)
    assert state["status"] == first["status"]  # incomplete: its max_output_tokens
    assert state["output"][-1]["content"] == first["output"][-1]["content"]
    with httpx.stream("GET", f"{base}/v1/responses/{bid}?stream=true&starting_after=0",
                      timeout=60) as s:  # fmt: skip
        events = [ln for ln in s.iter_lines() if ln.startswith("event: ")]
    assert events[0] == "event: response.in_progress"
    assert events[-1] == f"event: response.{first['status']}"
    r = httpx.post(f"{base}/v1/responses/{bid}/cancel", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == first["status"]  # it had ended
    assert httpx.delete(f"{base}/v1/responses/{bid}", timeout=10).json()["deleted"] is True
    assert httpx.get(f"{base}/v1/responses/{bid}", timeout=10).status_code == 404
    r = httpx.post(base + "/v1/responses", timeout=30, json={
        "model": model, "input": "hi", "previous_response_id": "resp_nobody"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    # Streamed through the Conductor: OpenAI's events, to the end.
    with httpx.stream("POST", base + "/v1/responses", json={**body, "stream": True},
                      timeout=120) as s:  # fmt: skip
        events = [ln for ln in s.iter_lines() if ln.startswith("event: ")]
    assert events[0] == "event: response.created"
    assert events[-1] == f"event: response.{first['status']}"


def test_ollama_through_the_cluster_answers_as_one_instance(cluster):
    """The Conductor answered Ollama's routes with 404s: Ollama clients (Open WebUI, the
    official libraries) could not use a cluster. /api/chat and /api/generate are now routed as
    the chat turn they mean (disaggregated), streamed as Ollama's NDJSON lines; the model list
    and the rest are any instance's."""
    import ollama

    _, _, _, running = cluster
    parts = {p.name: p for p in running.parts}
    base = running.endpoint.removesuffix("/v1")
    here, alone = ollama.Client(host=base), ollama.Client(host=parts["decode-0"].url)
    [model] = [m.model for m in here.list().models]
    user = [{"role": "user", "content": PROMPT}]
    opts = {"num_predict": 8, "temperature": 0}
    want = alone.chat(model=model, messages=user, options=opts, stream=False)
    before = httpx.get(base + "/metrics", timeout=10).text
    got = here.chat(model=model, messages=user, options=opts, stream=False)
    assert got.message.content == want.message.content and got.eval_count == 8
    after = httpx.get(base + "/metrics", timeout=10).text
    assert _count(after, "disaggregated") == _count(before, "disaggregated") + 1
    lines = list(here.chat(model=model, messages=user, options=opts, stream=True))
    assert lines[-1].done and "".join(p.message.content for p in lines) == want.message.content
    gen = here.generate(model=model, prompt=PROMPT, options=opts)
    assert gen.response == alone.generate(model=model, prompt=PROMPT, options=opts).response
    raw = here.generate(model=model, prompt=PROMPT, options=opts, raw=True)  # colocated
    assert raw.done and raw.eval_count == 8
    loaded = here.chat(model=model, messages=[])  # Ollama's load call: nothing to route
    assert loaded.done and loaded.done_reason == "load"
    assert here.show(model).capabilities and httpx.get(base + "/api/version").status_code == 200
    with pytest.raises(ollama.ResponseError) as err:
        here.chat(model=model, messages=user, options={"num_predict": 0})
    assert err.value.status_code == 400 and "num_predict" in err.value.error


def test_tokenize_through_the_cluster_is_an_instances(cluster):
    _, _, _, running = cluster
    parts = {p.name: p for p in running.parts}
    base = running.endpoint.removesuffix("/v1")
    for path, body in (("/tokenize", {"prompt": PROMPT}),
                       ("/tokenize", {"messages": [{"role": "user", "content": PROMPT}]}),
                       ("/detokenize", {"tokens": [5, 17, 230]})):  # fmt: skip
        here = httpx.post(base + path, json=body, timeout=30)
        alone = httpx.post(parts["decode-0"].url + path, json=body, timeout=30)
        assert here.status_code == 200 and here.json() == alone.json(), here.text
