import logging
import threading
import time

import httpx
import pytest
import uvicorn

from hetserve.bench.store_peers import free_port
from hetserve.config import EngineConfig
from hetserve.engine.async_llm import AsyncLLM
from hetserve.server.app import create_app


class LiveServer:
    def __init__(self, engine: AsyncLLM, api_key: str | None = None, **app_options):
        self.engine = engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(engine, "tiny", api_key=api_key, **app_options)
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("server did not start")

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def wait_idle(self, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            s = self.engine.stats()
            if (
                s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_used == 0
            ) or time.monotonic() > deadline:
                return s
            time.sleep(0.05)


@pytest.fixture(scope="session")
def engine(tiny_model):
    eng = AsyncLLM(
        EngineConfig(model=str(tiny_model("qwen3-moe", lm_head_scale=4.0)), max_model_len=256)
    )
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def server(engine):
    srv = LiveServer(engine)
    yield srv
    srv.stop()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def access_lines():
    """The access log's lines written while the test runs."""
    lines = _Lines()
    logging.getLogger("hetserve.access").addHandler(lines)
    yield lines.lines
    logging.getLogger("hetserve.access").removeHandler(lines)
