"""`hetserve serve` as a real process (what `make serve` runs), answering the openai client."""

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import torch

from tests.server.conftest import free_port


def test_serve_process_answers_openai_client(tiny_model, tmp_path):
    port = free_port()
    stats = tmp_path / "routing.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hetserve.cli",
            "serve",
            "--model",
            str(tiny_model("qwen3-moe")),
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            "--save-routing-stats",
            str(stats),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "HETSERVE_API_KEY": ""},
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        r = client.chat.completions.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
        assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert stats.is_file(), out  # routing statistics accumulated while serving, saved at exit
    # the default placement on a CPU-only machine, said in one line at start-up
    assert "placement: all-int8 (auto: no accelerator" in out or torch.cuda.is_available(), out
