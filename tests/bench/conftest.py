"""Servers for the benchmark tests: a small fake OpenAI-compatible streaming server with fixed,
known token timings, and the real `hetserve serve` on the demo model as a subprocess.

The fake runs an aiohttp app on 127.0.0.1 (a free port) in a background thread with its own event
loop, so the benchmark under test talks to it over real HTTP, exactly as it would to a real server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web


@dataclass
class FakeServerConfig:
    ttft_s: float = 0.05  # first token this long after the request arrives
    itl_s: float = 0.02  # then one token every itl_s
    omit_usage: bool = False  # never send a usage chunk, even when asked
    fail_every: int | None = None  # every k-th request (1-based) gets HTTP 500
    fail_midstream_every: int | None = None  # every k-th request breaks after its first token
    malformed_every: int | None = None  # every k-th request sends a chunk that is not OpenAI's
    api_key: str | None = None  # require this bearer token
    # The model card GET /v1/models lists (id "fake"); None: the server has no such route.
    card: dict[str, Any] | None = field(
        default_factory=lambda: {"id": "fake", "vocab_size": 1000, "max_model_len": 4096}
    )
    received: list[dict[str, Any]] = field(default_factory=list)  # request bodies, in order
    peak_concurrency: int = 0
    _active: int = 0


class FakeServer:
    def __init__(self, cfg: FakeServerConfig) -> None:
        self.cfg = cfg
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        if self.cfg.card is not None:
            app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()

    def start(self) -> FakeServer:
        self._thread.start()
        assert self._ready.wait(10), "fake server did not start"
        return self

    def stop(self) -> None:
        if not self._loop.is_running():
            return  # already stopped (tests stop it early to make it unreachable)
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _models(self, request: web.Request) -> web.Response:
        card = {"object": "model", "owned_by": "fake", **(self.cfg.card or {})}
        return web.json_response({"object": "list", "data": [card]})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        cfg = self.cfg
        body = await request.json()
        cfg.received.append(body)
        n = len(cfg.received)
        if cfg.api_key and request.headers.get("Authorization") != f"Bearer {cfg.api_key}":
            return web.json_response({"error": {"message": "bad api key"}}, status=401)
        if cfg.fail_every and n % cfg.fail_every == 0:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        return await self._stream(request, body, n)

    async def _stream(self, request: web.Request, body: dict, n: int) -> web.StreamResponse:
        cfg = self.cfg
        chat = "messages" in body
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        max_tokens = int(body["max_tokens"])
        # Counted only while tokens flow: the client cannot finish (and send its next request)
        # before [DONE], so a finished request is never still counted as active.
        cfg._active += 1
        cfg.peak_concurrency = max(cfg.peak_concurrency, cfg._active)
        try:
            await asyncio.sleep(cfg.ttft_s)
            for i in range(max_tokens):
                if i:
                    await asyncio.sleep(cfg.itl_s)
                if i == 1 and cfg.fail_midstream_every and n % cfg.fail_midstream_every == 0:
                    await _send(resp, {"error": {"message": "injected midstream failure"}})
                    break
                if i == 1 and cfg.malformed_every and n % cfg.malformed_every == 0:
                    await _send(resp, {"choices": 5})
                    break
                piece = f"t{i} "
                choice = {"delta": {"content": piece}} if chat else {"text": piece}
                last = i == max_tokens - 1
                choice |= {"index": 0, "finish_reason": "length" if last else None}
                await _send(resp, _chunk(body, chat, [choice]))
        finally:
            cfg._active -= 1
        want_usage = (body.get("stream_options") or {}).get("include_usage")
        if want_usage and not cfg.omit_usage:
            prompt = body.get("prompt", body.get("messages"))
            usage = {"prompt_tokens": len(prompt), "completion_tokens": max_tokens}
            await _send(resp, {**_chunk(body, chat, []), "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _chunk(body: dict, chat: bool, choices: list[dict]) -> dict:
    """A stream chunk with every field OpenAI's own chunks carry."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {
        "id": "cmpl-fake",
        "object": kind,
        "created": 0,
        "model": body.get("model"),
        "choices": choices,
    }


async def _send(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(f"data: {json.dumps(obj)}\n\n".encode())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_server():
    """Call with config fields to start a server; every started server is stopped after the test."""
    servers: list[FakeServer] = []

    def start(**kwargs: Any) -> FakeServer:
        server = FakeServer(FakeServerConfig(**kwargs)).start()
        servers.append(server)
        return server

    yield start
    for s in servers:
        s.stop()


class DemoServer:
    """`hetserve serve` on the demo model (vocabulary 576) as a real subprocess, logging to a file.

    Run as users run it, so what a soak or a benchmark sees (disconnects, tracebacks, memory) is
    what the command does, not what an in-process test app does.
    """

    def __init__(self, log_path: Path, max_model_len: int = 512) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "hetserve.cli", "serve", "--port", str(self.port),
               "--served-model-name", "demo", "--max-model-len", str(max_model_len)]  # fmt: skip
        self._log = log_path.open("w")
        env = {**os.environ, "HETSERVE_API_KEY": ""}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 240.0) -> DemoServer:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"server exited:\n{self.log()[-3000:]}"
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            assert time.monotonic() < deadline, f"server did not come up:\n{self.log()[-3000:]}"
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    """One demo-model server per test module (a soak may leave its server in any state)."""
    server = DemoServer(tmp_path_factory.mktemp("demo_server") / "server.log")
    try:
        yield server.wait_ready()
    finally:
        server.stop()
