"""Loopback servers and a loop-parametrized runner for the proxy.upstream tests.

An aiohttp app on port 0 plays a well-behaved engine; raw asyncio servers play broken ones.
Every test runs in a fresh loop of each kind (asyncio, uvloop) and must leave no task behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import orjson
import uvloop
from aiohttp import web

from proxy.upstream import (
    UpstreamClient,
)

Run = Callable[[Callable[[], Coroutine[Any, Any, None]]], None]
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop] | None] = {
    "asyncio": None,
    "uvloop": uvloop.new_event_loop,
}
BIG = 3 * 1024 * 1024


# -- servers ---------------------------------------------------------------------------------


class Engine:
    """The aiohttp fake engine's observations."""

    def __init__(self) -> None:
        self.url = ""
        self.gate = asyncio.Event()  # /sse sends its second half once this is set
        self.hung_up = asyncio.Event()  # /forever saw its client disconnect


def _engine_app(eng: Engine) -> web.Application:
    async def json_(request: web.Request) -> web.Response:
        body = await request.read()
        port = request.transport.get_extra_info("peername")[1]  # type: ignore[union-attr]
        echo = {
            "port": port,
            "body": body.decode(),
            "headers": [[str(k), v] for k, v in request.headers.items()],
        }
        return web.Response(body=orjson.dumps(echo), content_type="application/json")

    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        await eng.gate.wait()
        for i in range(5):
            await resp.write(b"data: %d\n\n" % i)
        await resp.write_eof()
        return resp

    async def forever(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            while True:
                await resp.write(b"data: tick\n\n")
                await asyncio.sleep(0.01)
        except (asyncio.CancelledError, ConnectionError):
            eng.hung_up.set()
            raise

    async def big(request: web.Request) -> web.StreamResponse:
        data = bytes(range(256)) * (BIG // 256)
        if request.query.get("chunked"):
            resp = web.StreamResponse()
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            for i in range(0, BIG, 100_000):
                await resp.write(data[i : i + 100_000])
            await resp.write_eof()
            return resp
        return web.Response(body=data)

    app = web.Application()
    app.router.add_post("/json", json_)
    app.router.add_post("/sse", sse)
    app.router.add_post("/forever", forever)
    app.router.add_post("/big", big)
    return app


@asynccontextmanager
async def engine() -> AsyncIterator[Engine]:
    eng = Engine()
    runner = web.AppRunner(_engine_app(eng), handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
    await site.start()
    eng.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        yield eng
    finally:
        eng.gate.set()
        await runner.cleanup()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A raw TCP server running ``handler`` per connection; yields its URL and a list that
    gets one entry per accepted connection."""
    accepted: list[int] = []
    tasks: set[asyncio.Task[Any]] = set()

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        accepted.append(1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            tasks.discard(task)

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request (head and Content-Length body), or b"" at end of stream."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b""
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def post(client: UpstreamClient, url: str, path: str = "/json") -> tuple[int, bytes]:
    async with await client.request("POST", url, path, [("X-A", "1")], b"{}") as r:
        return r.status, await r.read()
