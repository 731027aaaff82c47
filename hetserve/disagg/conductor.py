"""The Conductor: an OpenAI-compatible front door that routes each request across prefill and
decode instances by predicted time to first token, and refuses early what would miss its SLO.

Who calls it: `hetserve conductor` (entrypoints/conductor.py) builds it and its HTTP face
(`server/conductor_app.py`, which hands each request to `Conductor.route`); clients speak
OpenAI to it (`/v1/completions`, `/v1/chat/completions`, streaming passed through, `/v1/models`,
`/health`, `/metrics`). For each request it tokenizes the prompt as the instances do, hashes its
blocks with the cluster's KV identity, asks the KV index which instance holds which prefix in
which tier, and calls the pure policy (`policy.Router.decide`). Then:
- a colocated decision (one instance of role `both`): the request goes there as it is;
- a disaggregated one: the decode instance gets the request with a `kv_handoff` to receive, the
  prefill instance the same prompt with one output token and a `kv_handoff` to send (to the
  decode instance's address, or through the shared store); the client's stream is the decode
  instance's.
- a rejection: 429 with `Retry-After`, before any instance is touched; 503 (with
  `Retry-After`) while no healthy instance can prefill or none can decode.

Failure contract: bad input is the instances' own 400 (the body is forwarded unchanged) or one
caught here before routing (a body that is not JSON); an instance that cannot be reached before
its response starts is marked down and the request retried once elsewhere (colocated, on a
decode-capable instance); a stream that breaks mid-way ends with an error event and `[DONE]`.
Nothing a client sends makes the Conductor fail another request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hetserve.core.block_hash import salt_extra
from hetserve.disagg.adapters import Adapters
from hetserve.disagg.bodies import flag, int_field, is_int, output_limit, text_of
from hetserve.disagg.instances import Cluster
from hetserve.disagg.policy import Decision, RequestInfo, Router
from hetserve.native.hash_chain import hash_prefix_digests

log = logging.getLogger(__name__)
# The prefill half computes the prompt and one token: what would ask more of it goes.
PREFILL_DROPS = (
    "stream_options",
    "max_completion_tokens",
    "min_tokens",
    "logprobs",
    "top_logprobs",
)
HOLDINGS = Callable[[list[bytes]], Mapping[str, Mapping[str, int]]]
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class OtherAPI:
    """A route of another API the instances also serve (Anthropic's /v1/messages): how its
    body reads as a chat request (for hashing and the prefill half; raises where the instance
    would answer 400) and its error bodies' shape (from OpenAI's)."""

    to_chat: Callable[[dict], dict]
    error_shape: Callable[[dict], dict]
    # A stream's last event when its instance fails mid-way (None: OpenAI's data line).
    stream_error: Callable[[str], bytes] | None = None


@dataclass(frozen=True)
class ConductorConfig:
    handoff_path: str = "direct"  # "direct" or "store"
    handoff_timeout_s: float = 30.0
    api_key: str | None = None  # clients must present it (beyond loopback: required)
    # Changing the instances (/internal/instances, SGLang's /*_worker) takes this key; without
    # one, only a caller on this machine (with the clients' key, if any) may.
    admin_key: str | None = None
    # (name listed to clients, the instances' name) where `--served-model-name` renames it: a
    # request for the listed name is forwarded as the instances' (they refuse any other).
    model_alias: tuple[str, str] | None = None


def error_response(
    status: int,
    message: str,
    kind: str,
    headers: dict[str, str] | None = None,
    shape: Callable[[dict], dict] | None = None,
    param: str | None = None,
) -> JSONResponse:
    """The Conductor's own answer in OpenAI's error shape (or an API's, by `shape`)."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(shape(body) if shape else body, status_code=status, headers=headers)


class Conductor:
    def __init__(
        self,
        cluster: Cluster,
        router: Router,
        tokenizer: Any,
        config: ConductorConfig,
        holdings: HOLDINGS | None = None,
    ) -> None:
        self.cluster, self.router, self.tok, self.config = cluster, router, tokenizer, config
        self.holdings = holdings or (lambda hashes: {})
        self.decision_log: Any = None  # sim.decisions.DecisionLog: every decision, replayable
        self.request_log: Any = None  # core.trace_record.RequestLogWriter (hetserve sim's)
        self._pending_logs: dict[str, tuple[Any, float]] = {}  # request id -> (record, arrival)
        # request id -> its prefill half while it runs (cancelled if the decode half refuses)
        self._prefills: dict[str, asyncio.Task[None]] = {}
        # The KV index's size per instance and medium, for /metrics (None: no index).
        self.index_blocks: Callable[[], dict[str, dict[str, int]]] | None = None
        # A chat body's prompt as the instances' chat route renders it (tools, tool calls,
        # chat_template_kwargs: server/chat.py chat_prompt_text). None, or a body it refuses
        # (the instance will answer 400): the messages' roles and text alone.
        self.render_chat: Callable[[Mapping[str, Any]], str] | None = None
        # Other APIs' routes it serves, by path (the entrypoint gives Anthropic's).
        self.apis: dict[str, OtherAPI] = {}
        self.closing = False  # the Conductor is stopping: calls cut by it are no failures
        self.adapters = Adapters(cluster)  # LoRA adapters' content ids, for hashing
        cluster.prepare = self.adapters.replay  # runtime adapters on late or restarted ones
        self.started = time.monotonic()
        self.counts: dict[str, int] = {}
        self.ttft: list[tuple[float, float]] = []  # (predicted, measured) seconds, recent
        # Its own work per request, from the body read to the call to an instance (parse,
        # tokenize, hash, index, decide): recent seconds, for /metrics.
        self.routing: list[float] = []

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    # ---- one request -------------------------------------------------------------------------
    def prompt_ids(self, path: str, body: Mapping[str, Any]) -> list[int]:
        """The prompt as the instances will tokenize it (for hashing; the body is forwarded)."""
        # A body of the wrong shape is routed as what can be read of it: the instance it goes
        # to answers its 400, as it would alone.
        if path.endswith("/chat/completions"):
            if self.render_chat is not None:
                try:
                    rendered: list[int] = self.tok.encode(
                        self.render_chat(body),
                        add_special_tokens=flag(body, "add_special_tokens", False),
                    )
                    return rendered
                except Exception:  # noqa: BLE001 (refused or unreadable: the instance's 400)
                    pass
            messages = body.get("messages")
            msgs = [{"role": m.get("role"), "content": text_of(m.get("content"))}
                    for m in messages if isinstance(m, dict)
                    ] if isinstance(messages, list) else []  # fmt: skip
            text = self.tok.apply_chat_template(msgs, body.get("add_generation_prompt", True))
            ids: list[int] = self.tok.encode(text, add_special_tokens=False)
            return ids
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]  # several prompts: routed by the first
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            encoded: list[int] = self.tok.encode(
                prompt, add_special_tokens=flag(body, "add_special_tokens", True)
            )
            return encoded
        return [t for t in prompt if is_int(t)] if isinstance(prompt, list) else []

    def decide(
        self, path: str, body: Mapping[str, Any], arrived: float | None = None
    ) -> tuple[Decision, RequestInfo]:
        """Route one request (`arrived`: its `time.perf_counter()` on arrival, for the TTFT
        the request log records; None: now)."""
        ids = self.prompt_ids(path, body)
        keep = body.get("truncate_prompt_tokens")  # the instances keep the last `keep`
        if keep == -1:
            keep = self.cluster.model_card.get("max_model_len")
        if isinstance(keep, int) and not isinstance(keep, bool) and 0 < keep < len(ids):
            ids = ids[-keep:]
        extra = salt_extra(body.get("cache_salt"))  # in every block hash, as the instances do
        lora = self.adapters.id_of(body.get("model"))
        if lora is not None:  # no KV is shared across adapters: the instances hash it in
            extra = (*extra, f"lora:{lora}")
        bs, seed = self.cluster.block_size, self.cluster.hash_seed
        hashes = hash_prefix_digests(ids, bs, extra, seed)
        req = RequestInfo(
            uuid.uuid4().hex,
            len(ids),
            priority=int_field(body, "priority", 0),
            expected_output_tokens=output_limit(body),
        )
        view = self.cluster.view(self.holdings([h.digest for h in hashes]))
        now = time.monotonic()
        decision = self.router.decide(view, req, now)
        if self.decision_log is not None:
            self.decision_log.record(view, req, now, decision)
        if self.request_log is not None and ids:  # no prompt: the instances refuse it
            record = self._log_record(ids, body, decision, now, req.request_id)
            if decision.rejected:
                self.request_log.write(record)
            else:  # written once the answer starts, with the TTFT the cluster gave
                t0 = time.perf_counter() if arrived is None else arrived
                self._pending_logs[req.request_id] = (record, t0)
        return decision, req

    def _log_record(
        self, ids: list[int], body: Mapping[str, Any], d: Decision, now: float, request_id: str
    ) -> Any:
        from hetserve.core.trace_record import log_record

        extra: dict[str, Any] = {"rejected": d.rejected, "priority": int_field(body, "priority", 0),
                                 "request_id": request_id}  # fmt: skip
        record = log_record(
            # An unknown output length (no max_tokens) as 1: the instances log the real one.
            now - self.started, ids, max(1, output_limit(body)),
            self.cluster.block_size, (), self.cluster.hash_seed, **extra,
        )  # fmt: skip
        return record

    def _log_answer(self, request_id: str, first_token: bool, refused: bool = False) -> None:
        """The request's answer started (`first_token`: a stream's first chunk) or ended
        without one: its log record goes out, with the TTFT measured here where there is one
        (routing, the hops and the instances' work: what a client of the cluster waits).
        A request the instance `refused` as invalid (its 4xx) never ran: no record, as the
        instances write none (a replay would serve it)."""
        pending = self._pending_logs.pop(request_id, None)
        if pending is None or self.request_log is None or refused:
            return
        record, t0 = pending
        if first_token:
            record = replace(record, ttft_ms=(time.perf_counter() - t0) * 1e3)
        self.request_log.write(record)

    async def route(
        self, path: str, raw: bytes, request: Request, pinned: str | None = None
    ) -> Response:
        """Decide and forward one request; `pinned`: served colocated on that instance (it
        holds what the request continues: a stored Responses conversation)."""
        t0 = time.perf_counter()
        api = self.apis.get(path)
        shape = api.error_shape if api is not None else None
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError:
            return error_response(400, "request body is not a JSON object", "invalid_request_error",
                          shape=shape)  # fmt: skip
        chat = body  # the chat request it means: what is hashed and prefilled
        if api is not None:
            try:
                chat = api.to_chat(body)
            except Exception:  # noqa: BLE001 (refused: the instance answers its own 400)
                chat = {}
        await self.adapters.learn(body.get("model"), self.config.model_alias)
        decision, req = self.decide(CHAT if api is not None else path, chat, arrived=t0)
        if decision.rejected:
            self._count("rejected")
            retry = str(int(decision.retry_after_s or 1))
            if decision.unavailable:  # not the client's rate: the cluster is down
                msg = f"the cluster cannot serve requests now: {decision.reject_reason}"
                return error_response(503, msg, "service_unavailable", {"Retry-After": retry},
                                      shape)  # fmt: skip
            msg = f"the cluster cannot serve this request in time: {decision.reject_reason}"
            return error_response(429, msg, "rate_limit_error", {"Retry-After": retry}, shape)
        new = max(req.num_tokens - decision.cached_tokens, 1)
        # A hand-off carries one prompt's KV for one sequence: several prompts (or choices)
        # in one request are served where they decode.
        prompt = body.get("prompt")
        several = isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list)
        # Prompt logprobs turn the decode side's prefix lookup off: no hand-off could match.
        single = (decision.prefill == decision.decode or int_field(body, "n", 1) > 1 or several
                  or body.get("prompt_logprobs") is not None or not chat
                  or pinned is not None or body.get("use_beam_search") is True)  # fmt: skip
        # Colocated there, or the stream of a disaggregated request.
        target = pinned or decision.decode
        assert target is not None
        self.cluster.routed(pinned or decision.prefill, target, new)
        self._count("colocated" if single else "disaggregated")
        fwd = dict(body)
        alias = self.config.model_alias
        if alias is not None and fwd.get("model") == alias[0]:
            fwd["model"] = alias[1]
        if not single:  # the prefill half is the chat request the body means
            pre = chat if api is not None else fwd
            fwd["kv_handoff"] = self._handoff(decision, {**pre, "model": fwd.get("model")}, req)
        self.routing.append(time.perf_counter() - t0)
        del self.routing[:-1000]
        return await self._forward(path, target, fwd, request, decision, req.request_id, api)

    def _handoff(self, d: Decision, body: dict[str, Any], req: RequestInfo) -> dict[str, Any]:
        """Start the prefill half (in the background) and give the decode half its part."""
        assert d.prefill is not None and d.decode is not None
        key = req.request_id
        path, timeout = self.config.handoff_path, self.config.handoff_timeout_s
        decode = self.cluster.instances[d.decode]
        if path == "direct" and decode.handoff is None:
            path = "store"  # it receives only through the store
        pre = {k: v for k, v in body.items() if k not in PREFILL_DROPS}
        send = {"key": key, "role": "send", "path": path, "peer": decode.handoff}
        pre.update(stream=False, n=1, max_tokens=1, kv_handoff=send)
        task = asyncio.get_running_loop().create_task(self._prefill(d.prefill, pre, key))
        self._prefills[key] = task

        def done(t: asyncio.Task[None]) -> None:
            self._prefills.pop(key, None)
            if not t.cancelled():
                t.exception()  # retrieved (_prefill logs what it can)

        task.add_done_callback(done)
        return {"key": key, "role": "receive", "path": path, "timeout_s": timeout}

    async def _prefill(self, name: str, body: dict[str, Any], request_id: str) -> None:
        inst = self.cluster.instances.get(name)
        if inst is None:  # removed since the decision: the decode side recomputes
            self._count("prefill_failed")
            return
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        try:
            r = await self.cluster.http.post(
                inst.url + path, json=body, timeout=None, headers={"X-Request-Id": request_id}
            )
            if r.status_code != 200:
                log.warning("prefill on %s answered %s: %s", name, r.status_code, r.text[:200])
                self._count("prefill_failed")
        except httpx.HTTPError as exc:
            log.warning("prefill on %s failed: %s; the decode side recomputes", name, exc)
            self.cluster.mark_down(name)
            self._count("prefill_failed")

    async def _forward(
        self,
        path: str,
        name: str,
        body: dict[str, Any],
        request: Request,
        d: Decision,
        request_id: str,
        api: OtherAPI | None = None,
    ) -> Response:
        """Send to `name`; retried once on another decode-capable instance (colocated: no
        hand-off) if `name` cannot be reached before its response starts."""
        for attempt in range(2):
            inst = self.cluster.instances.get(name)
            t0 = time.monotonic()
            try:
                if inst is None:  # removed since the decision
                    raise httpx.ConnectError(f"instance {name} left the cluster")
                timeout = httpx.Timeout(10.0, read=None)  # a stream may pause for long
                req = self.cluster.http.build_request(
                    "POST", inst.url + path, json=body, timeout=timeout,
                    headers={"X-Request-Id": request_id},  # joins the instances' logs to ours
                )  # fmt: skip
                resp = await self.cluster.http.send(req, stream=True)
            except httpx.TransportError as exc:
                if self.closing:  # its connections closed under it: not the instance's fault
                    return error_response(503, "the Conductor is shutting down; retry later",
                                          "service_unavailable", {"Retry-After": "2"})  # fmt: skip
                self.cluster.mark_down(name)
                self._count("retried")
                other = self._fallback(name)
                if attempt or other is None:
                    self._log_answer(request_id, first_token=False)
                    msg = f"no instance could take the request: {exc}"
                    shape = api.error_shape if api is not None else None
                    return error_response(503, msg, "server_error", shape=shape)
                name, body = other, {k: v for k, v in body.items() if k != "kv_handoff"}
                continue
            return await self._relay(resp, request, d, t0, request_id, api)
        raise AssertionError("unreachable")

    async def forward_any(
        self, path: str, raw: bytes = b"", method: str = "POST", api: OtherAPI | None = None
    ) -> Response:
        """A request any instance answers alike and nothing is routed by (Anthropic's
        count_tokens, Ollama's model list): to the least loaded healthy one, its answer as it
        is (the Conductor's own errors in `api`'s shape)."""
        shape = api.error_shape if api is not None else None
        alive = [i for i in self.cluster.instances.values() if i.healthy]
        if not alive:
            return error_response(503, "no healthy instance", "service_unavailable", shape=shape)
        inst = min(alive, key=lambda i: (i.state().queued_requests, i.name))
        try:
            r = await self.cluster.http.request(
                method, inst.url + path, content=raw or None,
                headers={"content-type": "application/json"} if raw else None,
            )  # fmt: skip
        except httpx.HTTPError as exc:
            self.cluster.mark_down(inst.name)
            return error_response(503, f"the instance failed: {exc}", "server_error", shape=shape)
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type"))  # fmt: skip

    def _fallback(self, down: str) -> str | None:
        alive = [i for i in self.cluster.instances.values()
                 if i.healthy and i.name != down and i.role.decodes]  # fmt: skip
        return min(alive, key=lambda i: (i.state().running_decodes, i.name)).name if alive else None

    async def _relay(
        self,
        resp: httpx.Response,
        request: Request,
        d: Decision,
        t0: float,
        request_id: str,
        api: OtherAPI | None = None,
    ) -> Response:
        headers = {k: v for k, v in resp.headers.items()
                   if k.lower() in ("content-type", "x-request-id", "retry-after")}  # fmt: skip
        kind = resp.headers.get("content-type", "")
        if "text/event-stream" not in kind and "application/x-ndjson" not in kind:  # Ollama's
            data = await resp.aread()
            await resp.aclose()
            self._observe(d, time.monotonic() - t0)
            refused = 400 <= resp.status_code < 500 and resp.status_code != 429
            self._log_answer(request_id, first_token=False, refused=refused)
            prefill = self._prefills.pop(request_id, None)
            if prefill is not None and resp.status_code != 200:
                # Nothing will receive its KV: the instance aborts a request whose client left.
                prefill.cancel()
            return Response(data, status_code=resp.status_code, headers=headers)
        first = True

        async def chunks() -> AsyncIterator[bytes]:
            nonlocal first
            try:
                async for chunk in resp.aiter_raw():
                    if first:
                        self._observe(d, time.monotonic() - t0)
                        self._log_answer(request_id, first_token=resp.status_code == 200)
                        first = False
                    yield chunk
            except httpx.HTTPError as exc:  # the instance died mid-stream
                msg = f"the instance failed: {exc}"
                if api is not None and api.stream_error is not None:
                    yield api.stream_error(msg)  # the API's own error event
                else:
                    err = {"error": {"message": msg, "type": "server_error"}}
                    yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            finally:
                self._log_answer(request_id, first_token=False)  # no-op once written
                await resp.aclose()

        return StreamingResponse(chunks(), status_code=resp.status_code, headers=headers)

    def _observe(self, d: Decision, seconds: float) -> None:
        if d.predicted_ttft_s is not None:
            self.ttft.append((d.predicted_ttft_s, seconds))
            del self.ttft[:-1000]
