"""The bare TCP relay `bench conductor` measures its floor with: bytes pass unchanged both ways,
and a refused upstream closes the connection instead of hanging."""

from __future__ import annotations

import http.server
import threading

import httpx
import pytest

from hetserve.bench.relay import Relay
from hetserve.bench.store_peers import free_port


class _Echo(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[::-1])

    def log_message(self, *args) -> None:
        pass


def test_bytes_pass_both_ways_unchanged():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    relay = Relay("127.0.0.1", server.server_address[1])
    try:
        payload = bytes(range(256)) * 1000  # larger than one read of the pipe
        for _ in range(3):  # a fresh connection each time, as the bench makes them
            r = httpx.post(relay.url + "/x", content=payload, timeout=10)
            assert r.status_code == 200 and r.content == payload[::-1]
    finally:
        relay.close()
        server.shutdown()
    assert not relay.proc.is_alive()


def test_a_refused_upstream_closes_the_connection():
    relay = Relay("127.0.0.1", free_port())  # nothing listens there
    try:
        with pytest.raises(httpx.TransportError):
            httpx.post(relay.url + "/x", content=b"hi", timeout=10)
    finally:
        relay.close()
