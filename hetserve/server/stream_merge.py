"""Outputs of several engine request streams as they come (an `n` or a list of prompts on
one route). Who calls it: every route that queued more than one stream, and those with one
(a single stream passes straight through). Cancelling the consumer cancels the pending reads; a
cancelled read loses nothing, so nothing is dropped whatever the client does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from hetserve.core.outputs import RequestOutput
from hetserve.engine.async_llm import RequestStream


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index. Cancelling
    the consumer cancels the pending reads (a cancelled read loses nothing)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    nxt: Callable = lambda i: asyncio.ensure_future(anext(streams[i]))  # noqa: E731
    pending = {nxt(i): i for i in range(len(streams))}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    out = fut.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                pending[nxt(i)] = i
    finally:
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
