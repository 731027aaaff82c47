"""`hetserve conductor` in front of instances that ask for a key: the Conductor's `--api-key`
reaches them (as `serve --api-key K` / `conductor --api-key K` in the README's cluster by
hand), and an instance that refuses the key is one line naming the fix."""

import http.server
import threading

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
