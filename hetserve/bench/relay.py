"""A bare TCP relay, the floor under any front door: `bench conductor` sends the same requests
through it, straight to the instance and through the Conductor in one run, so the latency the
Conductor adds is read beside what one more loopback hop in its own process costs on this
machine (an asyncio byte pipe: no HTTP parsing, no routing).

Who calls it: `bench/conductor.py` (`Relay` starts it in a child process and stops it).
Failure contract: a relay that does not listen within 10 s is a RuntimeError; a connection
the upstream refuses is closed.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
import time

CHUNK = 1 << 16


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def _serve(port: int, host: str, upstream: int) -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(host, upstream)
        except OSError:
            w.close()
            return
        await asyncio.gather(_pipe(r, uw), _pipe(ur, w))

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def _main(port: int, host: str, upstream: int) -> None:
    asyncio.run(_serve(port, host, upstream))


class Relay:
    """A relay on a free loopback port in front of `host:upstream`, in its own process."""

    def __init__(self, host: str, upstream: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.proc = ctx.Process(target=_main, args=(self.port, host, upstream), daemon=True)
        self.proc.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.close()
        raise RuntimeError(f"the relay did not listen on port {self.port} within 10 s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.join(timeout=5)
