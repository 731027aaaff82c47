"""`hetserve profile --through URL`: what a running deployment adds to the prefill's compute.

An engine-only profile (`profiler.py`) prices the prefill and nothing around it; a client of a
deployment also waits for HTTP and tokenization, for the KV to be handed to a decode instance
and admitted there, and for the first token to come back through the Conductor. This probe
sends prompts of several lengths, one at a time (the deployment otherwise idle), streams each
until its first token, and fits `costs.DeliveryFit` to what the measured TTFT exceeds the
base profile's prefill prediction by. The result is the base profile with that fit: the
Conductor predicts with it and `hetserve sim --hardware` replays with it (a digital twin of
the deployment, not only of its engine).

Prompts are token ids (the OpenAI completions API takes them), drawn at random from ids 10 to
249 (byte tokens in the common vocabularies) with a fresh seed per probe, so no probe shares a
prefix block with another: every probe computes its whole prompt.

Who calls it: `entrypoints/profile.py`. Failure contract: a deployment that cannot be reached
or answers an error is an `InvalidInputError` naming the URL and the status; nothing is
retried.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import httpx

from hetserve.disagg.costs import DeliveryFit, InstanceProfile, fit_delivery
from hetserve.errors import InvalidInputError

LENGTHS = (16, 256, 1024, 2048)
TOKEN_IDS = range(10, 250)


def probe(
    url: str,
    base: InstanceProfile,
    lengths: Sequence[int] = LENGTHS,
    repeats: int = 3,
    api_key: str | None = None,
    on_sample: Callable[[int, float, float], None] | None = None,
) -> tuple[InstanceProfile, list[tuple[int, float]]]:
    """`base` with a delivery fit measured through the deployment at `url` (its /v1 root's
    host: `http://HOST:PORT`), and the (prompt tokens, seconds beyond the compute) samples.
    `on_sample(tokens, ttft_s, predicted_s)` sees each probe."""
    root = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(0x5EED)
    samples: list[tuple[int, float]] = []
    with httpx.Client(base_url=root, headers=headers, timeout=httpx.Timeout(10.0, read=600.0)) as c:
        model = _model(c, root)
        _first_token(c, model, [rng.choice(TOKEN_IDS) for _ in range(8)])  # warm the path
        for _ in range(repeats):
            for n in lengths:
                prompt = [rng.choice(TOKEN_IDS) for _ in range(n)]
                ttft = _first_token(c, model, prompt)
                predicted = base.prefill.seconds(n, 0)
                samples.append((n, ttft - predicted))
                if on_sample is not None:
                    on_sample(n, ttft, predicted)
    fit: DeliveryFit = fit_delivery(samples)
    return replace(base, delivery=fit), samples


def _model(c: httpx.Client, root: str) -> str:
    r = _call(c, root, "GET", "/v1/models")
    data = r.json().get("data") or []
    if not data:
        raise InvalidInputError(f"--through: {root}/v1/models lists no model", param="--through")
    return str(data[0]["id"])


def _first_token(c: httpx.Client, model: str, prompt: list[int]) -> float:
    """Seconds from sending `prompt` to its first streamed token."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter()
    try:
        with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise InvalidInputError(
                    f"--through: {c.base_url}/v1/completions answered {r.status_code}: "
                    f"{r.text[:200]}",
                    param="--through",
                )
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if json.loads(line[6:]).get("choices"):
                        return time.perf_counter() - t0
    except httpx.HTTPError as exc:
        raise InvalidInputError(f"--through: {c.base_url}: {exc}", param="--through") from None
    raise InvalidInputError(f"--through: {c.base_url} streamed no token", param="--through")


def _call(c: httpx.Client, root: str, method: str, path: str) -> httpx.Response:
    try:
        r = c.request(method, path)
    except httpx.HTTPError as exc:
        raise InvalidInputError(
            f"--through: cannot reach {root}: {exc}", param="--through"
        ) from None
    if r.status_code != 200:
        raise InvalidInputError(
            f"--through: {root}{path} answered {r.status_code}", param="--through"
        )
    return r
