"""Send one soak attempt and judge the server's answer.

`perform` records what happened on the wire (an `Answer`); `judge` puts it in exactly one bucket.
Kept apart so the rules are plain code that tests read without a server.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp

from hetserve.bench.soak.cases import BAD, Attempt

COMPLETED = "completed"  # a good request answered in full
ERROR_REPORTED = "error reported"  # a good request answered with a well-formed error
DISCONNECTED = "disconnected"  # cut by the client on purpose
FAILED = "failed"  # 5xx, a broken or hung stream, a connection error the client did not cause
BAD_REJECTED = "bad: 4xx JSON"  # a bad request answered with the right 4xx OpenAI error JSON
BAD_MISHANDLED = "bad: mishandled"  # accepted, or refused without the right status or JSON
BUCKETS = (COMPLETED, ERROR_REPORTED, DISCONNECTED, FAILED, BAD_REJECTED, BAD_MISHANDLED)


@dataclass
class Answer:
    """What the server did with one attempt, as seen by the client."""

    status: int | None = None  # None: no response came
    error_json: bool = False  # the body is an OpenAI error object {"error": {"message": ...}}
    choices: bool = False  # a non-streaming 200 carried choices
    done: bool = False  # the stream ended with data: [DONE]
    error_event: bool = False  # the stream carried data: {"error": ...}
    chunks: int = 0  # stream chunks received
    cut: bool = False  # the client disconnected on purpose
    upload_closed: bool = False  # the server closed the connection during a chunked upload
    problem: str | None = None  # transport failure, timeout or malformed data


async def perform(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    attempt: Attempt,
    timeout_s: float,
) -> Answer:
    ans = Answer()
    upload = not isinstance(attempt.body, bytes)
    data = attempt.body() if callable(attempt.body) else attempt.body
    cut_timer = asyncio.timeout(None)
    try:
        async with asyncio.timeout(timeout_s):
            async with cut_timer:
                if attempt.cut_after_s is not None:
                    cut_timer.reschedule(asyncio.get_running_loop().time() + attempt.cut_after_s)
                async with session.post(url, data=data, headers=headers) as resp:
                    ans.status = resp.status
                    if attempt.stream and resp.status == 200:
                        await _read_stream(resp, attempt, ans)
                    else:
                        _read_body(await resp.read(), ans)
    except TimeoutError:
        if cut_timer.expired():
            ans.cut = True
        else:
            ans.problem = f"no answer within {timeout_s:g} s"
    except aiohttp.ClientError as exc:
        ans.upload_closed = upload and ans.status is None
        ans.problem = f"{type(exc).__name__}: {exc}"[:160]
    return ans


async def _read_stream(resp: aiohttp.ClientResponse, attempt: Attempt, ans: Answer) -> None:
    async for raw in resp.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue  # blank separators, SSE comments
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            ans.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            ans.problem = f"stream chunk is not JSON: {data[:60]!r}"
            return
        if isinstance(chunk, dict) and "error" in chunk:
            ans.error_event = True
            continue  # [DONE] should follow
        ans.chunks += 1
        if attempt.cut_after_chunks is not None and ans.chunks >= attempt.cut_after_chunks:
            ans.cut = True
            resp.close()  # drop the connection mid-stream, as a client that goes away does
            return


def _read_body(body: bytes, ans: Answer) -> None:
    try:
        doc = json.loads(body)
    except ValueError:
        return
    if not isinstance(doc, dict):
        return
    err = doc.get("error")
    ans.error_json = isinstance(err, dict) and isinstance(err.get("message"), str)
    ans.choices = isinstance(doc.get("choices"), list) and bool(doc["choices"])


def judge(group: str, attempt: Attempt, ans: Answer) -> tuple[str, str]:
    """(bucket, why): why is "" for the expected outcomes, else one short line."""
    if ans.cut:
        return DISCONNECTED, ""
    if ans.status is None:
        if ans.upload_closed and 413 in attempt.expect:
            return BAD_REJECTED, "connection closed during the oversized upload"
        return FAILED, ans.problem or "no response"
    if ans.status >= 500:
        return FAILED, f"HTTP {ans.status}" + ("" if ans.error_json else " not OpenAI error JSON")
    if 400 <= ans.status < 500:
        return _judge_4xx(group, attempt, ans)
    if attempt.stream and not (ans.done or ans.error_event):
        return FAILED, ans.problem or "stream ended without [DONE] or an error event"
    if ans.problem:
        return FAILED, ans.problem
    if group == BAD:
        return BAD_MISHANDLED, f"accepted with HTTP {ans.status}"
    if attempt.stream:
        return (ERROR_REPORTED, "error event in the stream") if ans.error_event else (COMPLETED, "")
    if not ans.choices:
        return FAILED, f"HTTP {ans.status} without choices"
    return COMPLETED, ""


def _judge_4xx(group: str, attempt: Attempt, ans: Answer) -> tuple[str, str]:
    shape = "" if ans.error_json else " not OpenAI error JSON"
    if group != BAD:
        return ERROR_REPORTED, f"HTTP {ans.status}{shape}"
    if ans.status in attempt.expect and ans.error_json:
        return BAD_REJECTED, ""
    wanted = "/".join(map(str, attempt.expect))
    return BAD_MISHANDLED, f"HTTP {ans.status}{shape} (want {wanted})"
