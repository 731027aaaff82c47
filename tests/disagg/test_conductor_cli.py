"""`hetserve conductor` in front of instances that ask for a key: the Conductor's `--api-key`
reaches them (as `serve --api-key K` / `conductor --api-key K` in the README's cluster by
hand), and an instance that refuses the key is one line naming the fix."""

import http.server
import json
import threading

import httpx
import pytest

from hetserve.cli import main


class _Refuses(http.server.BaseHTTPRequestHandler):
    seen: list[str | None] = []

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        self.seen.append(self.headers.get("Authorization"))
        self.send_response(401)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def instance():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refuses)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Refuses.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_conductors_key_reaches_the_instances_and_a_refusal_is_one_line(
    instance, monkeypatch, capsys
):
    monkeypatch.delenv("HETSERVE_API_KEY", raising=False)
    argv = ["conductor", "--both", instance, "--port", "1", "--api-key", "k"]
    monkeypatch.setattr("hetserve.entrypoints.serve.check_port", lambda host, port: None)
    assert main(argv) == 2
    assert _Refuses.seen == ["Bearer k"]
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "refused the Conductor's API key" in err, err
    monkeypatch.setenv("HETSERVE_API_KEY", "theirs")  # the instances' own key, if it differs
    assert main(argv) == 2
    assert _Refuses.seen[-1] == "Bearer theirs"


class _Serves(http.server.BaseHTTPRequestHandler):
    """An instance of the model in `root`, served as 'tiny' (`serve --served-model-name`)."""

    root = ""

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        from hetserve.disagg.costs import DecodeFit, InstanceProfile, PrefillFit, profile_to_dict

        fits = PrefillFit(0.001, 0.0001, 0.0), DecodeFit(0.01, 0.001, 0.0)
        answers = {
            "/internal/info": {"role": "both", "block_size": 16, "hash_seed": "",
                               "profile": profile_to_dict(InstanceProfile("t", *fits, 1000))},
            "/v1/models": {"data": [{"id": "tiny", "root": self.root, "max_model_len": 64}]},
            "/internal/load": {"running_decodes": 0, "free_blocks": 10},
        }  # fmt: skip
        body = json.dumps(answers.get(self.path, {})).encode()
        self.send_response(200 if self.path in answers else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Serves.asked.append(body.get("model"))
        ok = body.get("model") in (None, "tiny")
        answer = {"id": "c", "object": "text_completion", "model": "tiny",
                  "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}  # fmt: skip
        out = json.dumps(answer if ok else {"error": {"message": "no such model"}}).encode()
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    asked: list = []

    def log_message(self, *args) -> None:
        pass


def test_a_served_model_name_of_the_conductors_own_reaches_the_instances_as_theirs(
    tmp_path, monkeypatch
):
    """`conductor --served-model-name alias` listed 'alias' and forwarded it unchanged: the
    instances, serving 'tiny', answered every request 404."""
    _Serves.root, _Serves.asked = str(tmp_path), []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Serves)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    seen = {}

    async def serve(self) -> None:
        transport = httpx.ASGITransport(app=self.config.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
            seen["models"] = (await client.get("/v1/models")).json()["data"][0]["id"]
            for model in ("alias", "tiny", "other"):
                body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 1}
                r = await client.post("/v1/completions", json=body)
                seen[model] = r.status_code

    monkeypatch.setattr("uvicorn.Server.serve", serve)
    monkeypatch.setattr("hetserve.model.tokenizer.Tokenizer", lambda d: None)
    monkeypatch.setattr("hetserve.entrypoints.serve.check_port", lambda host, port: None)
    monkeypatch.delenv("HETSERVE_API_KEY", raising=False)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        argv = ["conductor", "--both", url, "--port", "1", "--served-model-name", "alias"]
        assert main(argv) == 0
    finally:
        server.shutdown()
    assert seen == {"models": "alias", "alias": 200, "tiny": 200, "other": 404}
    assert _Serves.asked == ["tiny", "tiny", "other"]  # a name it does not list: unchanged


def test_the_conductor_lists_and_tokenizes_the_model_the_instances_serve(tmp_path, monkeypatch):
    """Without --model the Conductor listed 'hetserve-demo' and hashed prompts with the demo's
    tokenizer, whatever the instances served: a client that sent the listed name got the
    instances' 404 'model ... does not exist'."""
    _Serves.root = str(tmp_path)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Serves)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    seen = {}

    async def serve(self) -> None:  # uvicorn.Server.serve: ask the app instead of serving
        transport = httpx.ASGITransport(app=self.config.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
            seen["models"] = (await client.get("/v1/models")).json()["data"][0]["id"]

    monkeypatch.setattr("uvicorn.Server.serve", serve)
    monkeypatch.setattr("hetserve.model.tokenizer.Tokenizer", lambda d: seen.update(tok=str(d)))
    monkeypatch.setattr("hetserve.entrypoints.serve.check_port", lambda host, port: None)
    monkeypatch.delenv("HETSERVE_API_KEY", raising=False)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert main(["conductor", "--both", url, "--port", "1"]) == 0
    finally:
        server.shutdown()
    assert seen == {"models": "tiny", "tok": _Serves.root}


def test_the_instances_model_elsewhere_needs_model() -> None:
    from hetserve.entrypoints.conductor import served_model
    from hetserve.errors import InvalidInputError

    card = {"id": "tiny", "root": "/nonexistent/tiny"}
    with pytest.raises(InvalidInputError, match="pass --model"):
        served_model(None, None, card)
    assert served_model("/copy/of/tiny", None, card) == ("/copy/of/tiny", "tiny")
    assert served_model("/copy/of/tiny", "mine", card) == ("/copy/of/tiny", "mine")
    assert served_model(None, None, {}) == (None, "hetserve-demo")  # an instance without a card
